"""A ResNet-18 written as torchvision writes it profiles, plans on 4 workers, and its plans run stage by stage."""

from __future__ import annotations

import pytest
import torch

from partitioner import partition
from profiler.layers import layer_graph, structure_profile
from profiler.measure import profile_model
from random_models import run_stages
from resnet_torchvision import resnet18

pytestmark = pytest.mark.timeout(300)


def test_layer_names_follow_torchvision() -> None:
    g = layer_graph(resnet18(num_classes=10, width=16))
    assert g.names[:4] == ["conv1", "bn1", "relu", "maxpool"]
    assert "layer1_0_conv1" in g.names and "layer2_0_downsample_0" in g.names and "layer4_1_bn2" in g.names
    assert g.names[-3:] == ["avgpool", "flatten", "fc"]
    assert not g.tied


@pytest.mark.parametrize("straight", [False, True])
def test_profiles_and_plans_on_four_workers(straight: bool) -> None:
    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    profile = profile_model(model, x, warmup=0, repeats=1)
    assert len(profile) == 69 and all(l.kind == "tensor" for l in profile.layers)
    assert profile.structure_hash() == structure_profile(model).structure_hash()
    assert sum(l.parameter_bytes for l in profile.layers) == sum(p.numel() * 4 for p in model.parameters())
    plan = partition(profile, 4, 1e9, straight=straight)
    assert plan.world_size == 4 and plan.recompute == ()
    if straight:
        assert plan.num_stages == 4
    model.eval()
    run_stages(model, x, profile, plan)
