"""Loading and saving checkpoints: Hugging Face targets and z-lab-format DFlash drafters.

Weights are read with safetensors only. Every problem a user can fix (missing directory, missing
or corrupt weight file, a checkpoint of another architecture, bad draft-vocabulary ids) raises `UserError`.
A drafter's `model.safetensors` may carry two optional tensors besides the z-lab weights:
`mask_embedding` `(H,)` and `draft_vocab_ids` `(N,)` int64 (its draft vocabulary, see
`blockpilot.models.dflash`); the ids are never cast to the weights' dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from blockpilot.errors import UserError
from blockpilot.files import staged_directory
from blockpilot.models.config import DecoderConfig, DrafterConfig, read_config_json
from blockpilot.models.decoder import Decoder
from blockpilot.models.dflash import DFlashDrafter
from blockpilot.models.layers import RotaryTable

MASK_EMBEDDING_KEY = "mask_embedding"
DRAFT_VOCAB_KEY = "draft_vocab_ids"


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `model_dir` (sharded or not)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} has no *.safetensors weights; convert the checkpoint to safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{path} is corrupt or unreadable ({exc}); restore or re-download it") from None
    return tensors


def _assign(module: torch.nn.Module, state: dict[str, torch.Tensor], model_dir: Path, what: str) -> None:
    expected = set(module.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        detail = f"missing {sorted(missing)[:3]}" if missing else f"unexpected {sorted(unexpected)[:3]}"
        raise UserError(f"{model_dir} is not a {what} checkpoint of the configured shape ({detail})")
    for name, tensor in state.items():
        if tensor.shape != module.state_dict()[name].shape:
            raise UserError(
                f"{model_dir}: weight {name} has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(module.state_dict()[name].shape)}; the weights and config do not belong together"
            )
    module.load_state_dict(state, assign=True)


def read_draft_vocab_ids(model_dir: Path | str) -> torch.Tensor | None:
    """A drafter directory's `draft_vocab_ids` `(N,)` (None without one), read alone (no other tensor is loaded)."""
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt") as f:
                if DRAFT_VOCAB_KEY in f.keys():
                    return f.get_tensor(DRAFT_VOCAB_KEY)
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{path} is corrupt or unreadable ({exc}); restore or re-download it") from None
    return None


def load_target(model_dir: Path | str, dtype=torch.float32, max_positions: int | None = None) -> Decoder:
    """A `Decoder` from a Hugging Face Llama/Qwen2/Qwen3 directory (config.json + safetensors)."""
    model_dir = Path(model_dir)
    config = DecoderConfig.from_dict(read_config_json(model_dir), str(model_dir / "config.json"))
    state = {k.removeprefix("model."): v.to(dtype) for k, v in read_safetensors(model_dir).items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Decoder(config, max_positions=1)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state.get("embed_tokens.weight")
    _assign(model, {k: v for k, v in state.items() if v is not None}, model_dir, "target")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = RotaryTable(config, max_positions or config.max_position_embeddings).to(dtype=torch.float32)
    return model.eval()


def load_drafter(model_dir: Path | str, dtype=torch.float32, max_positions: int | None = None) -> DFlashDrafter:
    """A `DFlashDrafter` from a z-lab-format directory (config.json + model.safetensors)."""
    model_dir = Path(model_dir)
    config = DrafterConfig.from_dict(read_config_json(model_dir), str(model_dir / "config.json"))
    raw = {k.removeprefix("model."): v for k, v in read_safetensors(model_dir).items()}
    draft_vocab_ids = raw.pop(DRAFT_VOCAB_KEY, None)
    state = {k: v.to(dtype) for k, v in raw.items()}
    mask_embedding = state.pop(MASK_EMBEDDING_KEY, None)
    with torch.device("meta"):
        model = DFlashDrafter(config, max_positions=1)
    _assign(model, state, model_dir, "DFlash drafter")
    model.set_mask_embedding(mask_embedding)
    model.set_draft_vocabulary(draft_vocab_ids, source=str(model_dir / "model.safetensors"))
    model.rope = RotaryTable(config.layers, max_positions or config.layers.max_position_embeddings)
    return model.eval()


def save_drafter(drafter: DFlashDrafter, out_dir: Path | str, extra_files: dict[str, str] | None = None) -> Path:
    """Write `drafter` in z-lab format; the directory appears complete or not at all."""
    out_dir = Path(out_dir)
    with staged_directory(out_dir, replace=True) as tmp:
        state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items() if k != MASK_EMBEDDING_KEY}
        if drafter.mask_embedding is not None:
            state[MASK_EMBEDDING_KEY] = drafter.mask_embedding.detach().cpu().contiguous()
        if drafter.draft_vocab_ids is not None:
            state[DRAFT_VOCAB_KEY] = drafter.draft_vocab_ids.cpu().contiguous()
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = drafter.config.to_dict()
        config["torch_dtype"] = str(drafter.fc.weight.dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return out_dir
