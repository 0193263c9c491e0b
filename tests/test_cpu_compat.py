"""The CPU compatibility layer serves CUDA tensor requests on the CPU without lying to CUDA device queries.

It is process-global and permanent once applied, so each check runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_compiled_function_and_cuda_probes_under_the_redirect(tmp_path):
    """torch.compile's inductor probes ``torch.cuda.get_device_properties`` for its cache key and expects the
    AssertionError/RuntimeError of a machine without CUDA (is_initialized() == True alone made it a NameError)."""
    proc = _python(f"""
        import os
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = {str(tmp_path / "inductor")!r}
        import torch
        from dapo_mcore.model import cpu_compat
        if torch.cuda.is_available():
            print("SKIP cuda present"); raise SystemExit(0)
        assert cpu_compat.apply()

        @torch.compile(backend="inductor", dynamic=False)
        def f(x):
            return torch.softmax(x * 2, -1).sum(-1) + (x > 0.5).sum(-1)

        x = torch.rand(4, 8)
        assert torch.allclose(f(x), torch.softmax(x * 2, -1).sum(-1) + (x > 0.5).sum(-1))
        for probe in (torch.cuda.get_device_properties, torch.cuda.get_device_capability, torch.cuda.init):
            for kind in (RuntimeError, AssertionError):
                try:
                    probe() if probe is torch.cuda.init else probe(0)
                except kind as exc:
                    assert "not compiled with CUDA" in str(exc)
                else:
                    raise SystemExit(f"{{probe.__name__}} did not raise {{kind.__name__}}")
        # What the redirect is for still works: CUDA tensors on the CPU, Megatron's CUDA RNG tracker states.
        from megatron.core.tensor_parallel.random import _set_cuda_rng_state
        assert torch.ones(2, device="cuda").device.type == "cpu"
        torch.cuda.manual_seed(3)
        state = torch.cuda.get_rng_state()
        a = torch.rand(3, device="cuda", generator=torch.cuda.default_generators[0])
        _set_cuda_rng_state(state)  # runs at once through torch.cuda._lazy_call (is_initialized() is True)
        b = torch.rand(3, device="cuda", generator=torch.cuda.default_generators[0])
        assert torch.equal(a, b)
        print("OK")
    """)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] in ("OK", "SKIP cuda present"), proc.stdout


def test_tensor_factories_keep_their_sizes_and_to_still_redirects():
    """new_zeros(2, 3) takes sizes positionally (they once were read as CUDA device indices); `to` takes a device."""
    proc = _python("""
        import torch
        from dapo_mcore.model import cpu_compat
        cpu_compat.apply()
        t = torch.ones(4)
        assert t.new_zeros(2, 3).shape == (2, 3) and t.new_ones(1, 5).shape == (1, 5)
        assert t.new_empty(3, 2).shape == (3, 2) and t.new_full((2,), 7.0).tolist() == [7.0, 7.0]
        assert t.to("cuda").device.type == "cpu" and t.to(0).device.type == "cpu"
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_a_recompute_inside_backward_still_redirects():
    """A full recompute runs the layer's forward again inside backward (Megatron's CheckpointFunction; its MoE router
    moves its weight to torch.cuda.current_device() on every call). torch 2.13 hands backward() to the mode, which is
    off while its handler runs: the recompute then met CUDA ('Cannot access accelerator device'). Both spellings of
    backward, with a gradient given and not, must reach the same gradients as without the recompute."""
    proc = _python("""
        import torch
        from torch.utils.checkpoint import checkpoint
        from dapo_mcore.model import cpu_compat
        cpu_compat.apply()
        w = torch.nn.Parameter(torch.randn(3, 3))

        def layer(x):
            return torch.tanh(x @ w.to(device=torch.cuda.current_device()))

        x = torch.randn(2, 3, requires_grad=True)
        torch.autograd.backward(checkpoint(layer, x, use_reentrant=True).sum())
        recomputed = w.grad.clone()
        w.grad = None
        layer(x).sum().backward()
        assert torch.equal(w.grad, recomputed), (w.grad, recomputed)
        w.grad = None
        checkpoint(layer, x, use_reentrant=True).backward(gradient=torch.ones(2, 3))
        assert torch.equal(w.grad, recomputed)
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
