"""Model configurations read from Hugging Face `config.json` files.

`DecoderConfig` covers the three supported decoder families (Llama, Qwen2, Qwen3) and the DFlash
drafter's layer shape; `DrafterConfig` adds the DFlash fields (block size, mask token, tap layers).
Only the fields the networks need are kept; everything else in `config.json` is ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch

from blockpilot.errors import UserError

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")
_ROPE_TYPES_FROM_TRANSFORMERS = ("linear", "llama3", "yarn", "longrope")


@contextlib.contextmanager
def _config_fields(source: str):
    """Turn a missing or malformed field met while parsing `source` into a `UserError`."""
    try:
        yield
    except KeyError as exc:
        raise UserError(f"{source} has no {exc.args[0]!r} field; restore the complete config file") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"{source} has a malformed field ({exc}); restore the config file") from None


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "DecoderConfig":
        with _config_fields(source):
            family = raw.get("model_type")
            if family not in SUPPORTED_FAMILIES:
                raise UserError(
                    f"{source}: model_type {family!r} is not supported; "
                    f"use a {', '.join(SUPPORTED_FAMILIES)} checkpoint"
                )
            heads = int(raw["num_attention_heads"])
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", *_ROPE_TYPES_FROM_TRANSFORMERS):
                raise UserError(f"{source}: RoPE type {rope_type!r} is not supported")
            return cls(
                family=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=dict(rope, rope_type=rope_type) if rope_type != "default" else None,
                attention_bias=bool(raw.get("attention_bias", family == "qwen2")),
                qk_norm=family == "qwen3",
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            )

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse RoPE frequencies `(head_dim // 2,)` and the cos/sin scaling factor."""
        if self.rope_scaling is None:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
            return (1.0 / self.rope_theta**exponents).float(), 1.0
        from transformers import PretrainedConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = PretrainedConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
        )
        hf.rope_parameters = dict(self.rope_scaling, rope_theta=self.rope_theta)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_scaling["rope_type"]](hf, "cpu")
        return inv_freq.float(), float(scaling)


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter: Qwen3-style layers plus the fields that tie it to its target."""

    layers: DecoderConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "DrafterConfig":
        with _config_fields(source):
            dflash = raw.get("dflash_config") or {}
            missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
            if missing or "block_size" not in raw:
                raise UserError(
                    f"{source} is not a DFlash drafter config (missing "
                    f"{', '.join(missing + ([] if 'block_size' in raw else ['block_size']))}); "
                    "pass a z-lab-format drafter directory"
                )
            layers = DecoderConfig.from_dict(raw, source)
            return cls(
                layers=dataclasses.replace(layers, qk_norm=True),
                block_size=int(raw["block_size"]),
                mask_token_id=int(dflash["mask_token_id"]),
                target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
                num_target_layers=int(raw.get("num_target_layers", 0)),
            )

    def to_dict(self) -> dict:
        """The z-lab `config.json` layout."""
        c = self.layers
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "num_target_layers": self.num_target_layers,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            **({"rope_scaling": c.rope_scaling} if c.rope_scaling else {}),
            "max_position_embeddings": c.max_position_embeddings,
            "attention_bias": c.attention_bias,
            "vocab_size": c.vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """DFlash's tap choice: `round(1 + i * (L - 4) / (n - 1))` for `n` taps over `L` layers."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps))


def read_config_json(model_dir: Path) -> dict:
    """The parsed `config.json` of `model_dir`, or a `UserError` saying what is wrong."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise UserError(f"{model_dir}: no such model directory")
    if not path.is_file():
        raise UserError(f"{path} is missing; pass a Hugging Face model directory")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); restore the file") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} is not a JSON object; restore the model's config.json")
    return raw


def check_drafter_fits_target(target: DecoderConfig, drafter: DrafterConfig, where: str = "drafter") -> None:
    """Raise `UserError` naming the first field on which `drafter` does not fit `target`."""
    d = drafter.layers
    problems = []
    if d.hidden_size != target.hidden_size:
        problems.append(f"hidden size {d.hidden_size} != target's {target.hidden_size}")
    if drafter.num_target_layers and drafter.num_target_layers != target.num_hidden_layers:
        problems.append(
            f"num_target_layers {drafter.num_target_layers} != target's {target.num_hidden_layers} layers"
        )
    if d.vocab_size != target.vocab_size:
        problems.append(f"vocab size {d.vocab_size} != target's {target.vocab_size}")
    bad_taps = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad_taps:
        problems.append(f"target_layer_ids {bad_taps} out of range for {target.num_hidden_layers} target layers")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {drafter.mask_token_id} out of range for vocab size {target.vocab_size}")
    if drafter.block_size < 1:
        problems.append(f"block_size {drafter.block_size} < 1")
    if problems:
        raise UserError(f"{where} does not fit the target: {problems[0]}; use a drafter trained for this target")
