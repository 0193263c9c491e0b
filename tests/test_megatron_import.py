"""dapo_mcore.model.megatron_import: Megatron-Core's import without TorchDynamo/Inductor and W&B, with the same
behaviour: a deferred ``torch.compile`` compiles at the first call exactly once, W&B is refused only to the thread
loading megatron.core, and a fresh process importing the model stack loads neither."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from dapo_mcore.model import megatron_import as mi

pytestmark = pytest.mark.unit


def test_a_deferred_compile_calls_the_real_one_at_the_first_call_only():
    calls = []

    def real(model, **kwargs):
        calls.append((getattr(model, "__name__", type(model).__name__), kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))

    compile_ = mi.deferred_compile(real)

    @compile_
    def double(x):
        return 2 * x

    @compile_(dynamic=True)
    def triple(x):
        return 3 * x

    assert calls == [] and double.__name__ == "double" and double.__wrapped__(4) == 8
    assert double(2) == ("compiled", 4) and double(5) == ("compiled", 10)
    assert triple(1) == ("compiled", 3)
    assert calls == [("double", {}), ("triple", {"dynamic": True})]  # once each, with its own options
    compile_(torch.nn.Linear(2, 2), mode="x")  # a module: straight to the real one, at once
    assert calls[-1] == ("Linear", {"mode": "x"}) and len(calls) == 3


def test_wandb_is_refused_only_to_the_thread_loading_megatron_core():
    seen = {}

    def other_thread():
        seen["other"] = mi._FINDER.find_spec("wandb", None)  # not loading megatron: no say (None)

    with mi._megatron_loading():
        with pytest.raises(ImportError, match="while megatron.core loads"):
            mi._FINDER.find_spec("wandb", None)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert isinstance(torch.compile, type(mi.deferred_compile(None)))  # swapped while loading
    assert seen == {"other": None}
    assert mi._FINDER.find_spec("wandb", None) is None
    assert torch.compile.__module__ == "torch"  # the real one again


def test_a_fresh_process_loads_the_megatron_model_without_dynamo_or_wandb(tmp_path):
    code = (
        "import sys, json, dapo_mcore, megatron.core\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "from megatron.core import timers, jit\n"
        "out = {'dynamo': 'torch._dynamo' in sys.modules, 'wandb_loaded': 'wandb' in sys.modules,\n"
        "       'timers_wandb': timers.wandb is None, 'jit_deferred': jit.jit_fuser.__name__ == 'compile_'}\n"
        "import torch; out['compile_restored'] = torch.compile.__module__ == 'torch'\n"
        "import wandb; out['wandb_after'] = wandb.__name__\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"dynamo": False, "wandb_loaded": False, "timers_wandb": True, "jit_deferred": True,
                   "compile_restored": True, "wandb_after": "wandb"}, out


def test_the_switch_leaves_the_import_plain(monkeypatch):
    monkeypatch.setenv("DAPO_MCORE_PLAIN_MEGATRON_IMPORT", "1")
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not mi._FINDER])
    mi.install()
    assert not mi.installed()
    monkeypatch.delenv("DAPO_MCORE_PLAIN_MEGATRON_IMPORT")
    mi.install()
    mi.install()
    assert sys.meta_path.count(mi._FINDER) == 1 and sys.meta_path[0] is mi._FINDER
