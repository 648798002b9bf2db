"""The transformers DFlash adapter proposes exactly what our drafter proposes, step after step."""

import pytest
import torch

from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.profiling.hf_dflash import DFlashAssistant
from blockpilot.runtime.backend import TorchBackend

from fixtures import make_drafter, make_hf_target

BLOCK = 6
PROMPT = [5, 17, 42, 8, 61, 23, 9, 77, 30]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-dflash")
    target = make_hf_target(tmp, "qwen3")
    return load_target(target), load_drafter(make_drafter(tmp, target, block_size=BLOCK, layers=2))


def _assistant_proposals(assistant, target, cache, last, taps, ctx_start, block_start, crop):
    """Call the assistant as transformers' DFlashTokenCandidateGenerator does; argmax proposals (1, B-1)."""
    n = taps.shape[1]
    cache.set_previous_accepted_tokens(n)
    if crop:
        cache.crop(-BLOCK)  # drop the previous block's K/V
    noise_ids = torch.tensor([[int(last)] + [assistant.config.mask_token_id] * (BLOCK - 1)])
    position_ids = torch.cat((torch.arange(ctx_start, ctx_start + n), torch.arange(block_start, block_start + BLOCK)))
    out = assistant(noise_embeds=target.embed_tokens(noise_ids), context_hidden_states=taps,
                    position_ids=position_ids[None], attention_mask=None, cache=cache)
    return target.lm_head(out.last_hidden_state[:, 1:]).argmax(-1)


@pytest.mark.parametrize("learned_mask", [False, True])
@torch.inference_mode()
def test_adapter_proposals_equal_torch_backend_draft_across_steps(tiny, learned_mask):
    from transformers.cache_utils import DFlashCache

    target, drafter = tiny
    scale = target.embed_tokens.weight.std()  # a mask embedding on the embeddings' scale, so context still matters
    drafter.set_mask_embedding(torch.randn(drafter.config.layers.hidden_size) * scale if learned_mask else None)
    backend = TorchBackend(target, drafter)
    assistant = DFlashAssistant(drafter)
    assert (assistant.config.block_size, assistant.config.mask_token_id) == (BLOCK, drafter.config.mask_token_id)
    assert assistant.config.target_layer_ids == list(drafter.config.target_layer_ids)

    state = backend.new_state(1, 128)
    prefill = backend.prefill(state, torch.tensor([PROMPT]))
    cache = DFlashCache(config=assistant.config)
    last, taps, ctx_start, pos = prefill.last_logits.argmax(-1), prefill.taps, 0, len(PROMPT)
    for step, accepted in enumerate([2, 0, 5, 1]):  # committed drafts per step (any prefix works here)
        ours = backend.draft(state, last, taps, ctx_start, pos, BLOCK)
        theirs = _assistant_proposals(assistant, target, cache, last, taps, ctx_start, pos, crop=step > 0)
        assert theirs.tolist() == ours.tolist(), f"step {step}"
        ctx_start += taps.shape[1]
        verify = backend.verify(state, torch.cat((last[:, None], ours), dim=1), pos)
        taps = verify.taps[:, : accepted + 1]
        last = verify.logits[:, accepted].argmax(-1)
        pos += accepted + 1
    drafter.set_mask_embedding(None)
