"""One family table: every model family ``train`` accepts, ``rehearse``, ``plan``, ``config`` and ``verify`` accept
too, and a model directory's name picks its preset the same way in ``config``, ``plan`` and ``rehearse``."""

from __future__ import annotations

import pytest

from dapo_mcore.commands.config import infer_preset
from dapo_mcore.commands.plan import plan_input_from_config, validate_config_layout
from dapo_mcore.commands.rehearse import recipe_model, shrunk_model
from dapo_mcore.config import load_config
from dapo_mcore.model.hf_config import FAMILIES
from dapo_mcore.model.presets import PRESET_NAMES, preset_config, preset_named_by
from dapo_mcore.model.qwen import QwenShape
from dapo_mcore.weights.registry import get_mapping

pytestmark = pytest.mark.unit

BIG = {family: next(n for n in PRESET_NAMES if preset_config(n)["model_type"] == family
                    and not n.startswith("tiny")) for family in FAMILIES}


def test_every_family_has_a_full_size_preset():
    assert set(BIG) == set(FAMILIES) and "llama" in BIG


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_train_builds_is_accepted_by_every_command(family):
    name = BIG[family]
    hf = preset_config(name)
    QwenShape.from_hf(hf)  # train: the model builds from it
    get_mapping(hf)  # train's checkpoints, convert and verify: the weight mapping
    for pp, vpp in ((1, None), (2, 2)):  # rehearse: the shrunk model is the same family, and train accepts it
        small = shrunk_model(hf, pp, vpp)
        assert small["model_type"] == family
        QwenShape.from_hf(small)
        get_mapping(small)
    cfg = load_config(None, [f"model.preset={name}", "model.tiny_base=false"])
    cfg.model.validate()  # config
    validate_config_layout(cfg, 8)  # plan
    assert plan_input_from_config(cfg, 8).model["model_type"] == family


@pytest.mark.parametrize("path, preset", [("/models/Qwen2.5-32B", "qwen2.5-32b"), ("/m/Llama-3.1-8B", "llama3.1-8b"),
                                          ("/m/Llama-3.1-8B-Instruct/", "llama3.1-8b"), ("/m/Qwen3-30B-A3B", "qwen3-30b-a3b"),
                                          ("/m/qwen3-8b", "qwen3-8b"), ("/m/Mistral-7B", None)])
def test_a_model_directory_not_here_is_planned_as_the_preset_its_name_names(path, preset):
    assert preset_named_by(path) == preset
    cfg = load_config(None, [f"model.hf_path={path}", "model.tiny_base=false"])
    inferred, note = infer_preset(cfg)
    assert inferred.model.preset == preset and (note is not None) == (preset is not None)
    if preset is not None:  # rehearse picks the same
        assert recipe_model(cfg)[0] == preset_config(preset)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_model_build_line_names_the_family(family):
    from dapo_mcore.model.qwen import family_label

    label = family_label(preset_config(BIG[family]))
    assert label == FAMILIES[family].label and (family != "llama" or label.startswith("Llama"))
