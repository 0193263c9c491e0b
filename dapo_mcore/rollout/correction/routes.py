"""Rollout routing replay (R3), engine side: the experts an MoE model routed each token to while sampling.

`RouteRecorder` hooks the router of every sparse layer of a transformers MoE model (``Qwen3MoeTopKRouter``
returns ``(router_logits, top-k weights, top-k indices)``) and writes each forward's top-k indices into a table
``[rows, positions, MoE layers, top_k]`` by sequence position (prompt tokens from 0, then the response). The
prefill fills a row's prompt positions; each decode step fills the position of the token it feeds back. The last
sampled token is never fed back, so its position stays -1 ("not recorded"): its output predicts nothing the loss
uses. A response carries its row (``Response.routed_experts``) to the trainer, whose router replays it
(``algo.router_replay: rollout``, model/moe.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_mcore.actor.route_exchange import UNKNOWN


class RouteRecorder:
    """Top-k expert indices per token and MoE layer of one engine's decode calls."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("MoeTopKRouter")]
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self.table: Tensor | None = None
        self._where: tuple[Tensor, Tensor] | None = None  # (row index, position) of each token of the next forward
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def _hook(self, layer: int):
        def record(_module, _inputs, output) -> None:
            if self.table is None or self._where is None:
                return
            rows, pos = self._where
            self.table[rows, pos, layer] = output[2].view(rows.numel(), -1).to(self.table.dtype)
        return record

    def begin(self, rows: int, positions: int) -> None:
        """A new decode call of `rows` rows and at most `positions` tokens per row."""
        self.table = torch.full((rows, positions, len(self.routers), self.top_k), UNKNOWN, dtype=torch.int16)

    def prefill(self, lens: Tensor, width: int) -> None:
        """The next forward is the left-padded prefill ``[len(lens), width]``: row i's prompt sits in the last
        ``lens[i]`` columns; padding columns are recorded at a dump position and dropped by `expand`."""
        n = lens.numel()
        cols = torch.arange(width).unsqueeze(0).expand(n, width)
        pos = cols - (width - lens.cpu().unsqueeze(1))
        pos = torch.where(pos >= 0, pos, torch.full_like(pos, self.table.shape[1] - 1))
        self._where = (torch.arange(n).unsqueeze(1).expand(n, width).reshape(-1), pos.reshape(-1))

    def expand(self, n: int, lens: Tensor) -> None:
        """After the prefill of the prompts, each prompt's row becomes `n` sample rows (prompt i -> rows i*n..)."""
        assert self.table is not None
        dump = self.table.shape[1] - 1
        self.table[:, dump] = UNKNOWN  # padding columns of the prefill landed here
        self.table = self.table[: lens.numel()].repeat_interleave(n, dim=0).contiguous()

    def step(self, rows: Tensor, positions: Tensor) -> None:
        """The next forward feeds one token to each of `rows` (original row indices) at `positions`."""
        self._where = (rows.cpu(), positions.cpu())

    def done(self) -> None:
        self._where = None

    def rows(self, rows: slice | Tensor, lens: list[int]) -> list[Tensor]:
        """Each row's recorded routes over its first ``lens[i]`` positions (prompt + response)."""
        assert self.table is not None
        picked = self.table[rows]
        return [picked[i, :n].clone() for i, n in enumerate(lens)]


def routes_from_vllm(routed: object, length: int) -> Tensor:
    """vLLM's ``CompletionOutput.routed_experts`` (numpy ``[tokens, MoE layers, top_k]`` from the first prompt token
    on, vLLM >= 0.32 with ``enable_return_routed_experts``) in the engine-neutral form: int16 over the prompt +
    response's `length` positions, -1 where vLLM returned none (e.g. the last sampled token). Not run on a GPU."""
    table = torch.as_tensor(routed).to(torch.int16)
    out = torch.full((length, *table.shape[1:]), UNKNOWN, dtype=torch.int16)
    n = min(length, table.shape[0])
    out[:n] = table[:n]
    return out
