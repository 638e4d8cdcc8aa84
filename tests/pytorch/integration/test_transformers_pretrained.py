"""Hugging Face ``transformers`` as a real client: a ``PreTrainedModel`` holding a
``TransformerLayer`` is saved with ``save_pretrained`` and loaded with ``from_pretrained``, and
accelerate's ``has_transformer_engine_layers`` finds the layer.

transformers and accelerate are optional test dependencies (the ``integration`` extra of
pyproject.toml, installed on the GPU machine); each test skips with the reason when its package
is missing. The model is built from a config with random weights: nothing is downloaded. The
tests run on the CPU, and once more on a GPU where there is one.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from utils import autocast_by_name

from transformer_engine.pytorch.transformer import TransformerLayer

HIDDEN, FFN, HEADS, SEQ, BATCH = 64, 128, 4, 16, 2
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# save_pretrained writes safetensors, which hold tensors only, and transformers reads every
# state-dict value as a tensor: every _extra_state is a torch.uint8 tensor (empty without FP8
# state, else the bytes of transformer_engine.pytorch.extra_state's format, no pickle).


def require(name: str):
    """The module ``name``, or a skip naming the extra that provides it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        pytest.skip(f"needs {name} (the integration extra of pyproject.toml): {err}")


def model_classes(transformers):
    """A config and a PreTrainedModel around one TransformerLayer (built per test: transformers
    is imported inside the tests)."""

    class TinyTransformerConfig(transformers.PretrainedConfig):
        model_type = "te_tiny_transformer"

        def __init__(self, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                     layer_device="cpu", **kwargs):  # fmt: skip
            self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
            self.num_attention_heads, self.layer_device = num_attention_heads, layer_device
            super().__init__(**kwargs)

    class TinyTransformerModel(transformers.PreTrainedModel):
        config_class = TinyTransformerConfig
        base_model_prefix = "tiny"

        def __init__(self, config):
            super().__init__(config)
            self.layer = TransformerLayer(
                config.hidden_size, config.ffn_hidden_size, config.num_attention_heads,
                hidden_dropout=0.0, attention_dropout=0.0, device=config.layer_device,
            )  # fmt: skip
            self.post_init()

        def _init_weights(self, module):
            pass  # the layer initializes itself (N(0, 0.023), norms 1, biases 0)

        def forward(self, hidden_states):
            return self.layer(hidden_states)

    return TinyTransformerConfig, TinyTransformerModel


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_state", [False, True])
def test_save_pretrained_then_from_pretrained(tmp_path, device, fp8_state):
    transformers = require("transformers")
    config_class, model_class = model_classes(transformers)
    torch.manual_seed(0)
    model = model_class(config_class(layer_device=device)).eval()
    x = torch.randn(SEQ, BATCH, HIDDEN, device=device)
    if fp8_state:  # the layer has delayed-scaling state (its _extra_state) to carry along
        with autocast_by_name("delayed"):
            model(x).sum().backward()
    expected = model(x)
    model.save_pretrained(tmp_path)
    # from_pretrained builds on the CPU (placement is the caller's: .to() or device_map);
    # the FP8 state follows the module there
    loaded = model_class.from_pretrained(tmp_path).to(device).eval()
    assert isinstance(loaded.layer, TransformerLayer)
    original, restored = model.state_dict(), loaded.state_dict()
    for name, value in original.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(restored[name].cpu(), value.cpu()), name
    assert {p.device.type for p in loaded.parameters()} == {torch.device(device).type}
    torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)


def test_accelerate_finds_the_transformer_layer():
    transformers = require("transformers")
    accelerate_te = require("accelerate.utils.transformer_engine")
    config_class, model_class = model_classes(transformers)
    model = model_class(config_class())
    assert accelerate_te.has_transformer_engine_layers(model)
    assert not accelerate_te.has_transformer_engine_layers(torch.nn.Sequential(torch.nn.ReLU()))
