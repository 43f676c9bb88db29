"""Greedy generation after a prompt and decoded perplexity (subquad.hf.generation), on a tiny
random Llama: exact attention retrofitted as ``softmax`` must agree with the model everywhere."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import subquad.hf as H  # noqa: E402
from subquad.hf import generation as G  # noqa: E402
from test_retrofit import _ids, tiny_llama  # noqa: E402

transformers.logging.set_verbosity_error()


def test_exact_retrofit_agrees_free_running_and_teacher_forced():
    model = tiny_llama()
    ids = _ids(1, 24)
    exact = G.exact_generation(model, ids, 6)
    assert len(exact["tokens"]) == 6 and exact["text"] is None
    H.retrofit(model, "softmax")
    g = G.generation_agreement(model, ids, exact)
    assert g["tokens"] == exact["tokens"]
    assert (g["free_same"], g["forced_same"], g["first_difference"]) == (1.0, 1.0, None)


def test_teacher_forcing_feeds_the_given_tokens():
    """Fed other tokens than its own, the model's next tokens are those of the fed history."""
    model = tiny_llama()
    ids = _ids(1, 16)
    feed = torch.tensor([7, 8, 9, 10])
    tokens, seconds = G.greedy_steps(model, ids, transformers.DynamicCache(), 5, feed=feed)
    assert len(seconds) == 4
    with torch.no_grad():
        full = model(input_ids=torch.cat([ids, feed[None]], 1)).logits[0, ids.shape[1] - 1:].argmax(-1)
    assert tokens == full.tolist()


def test_a_differing_continuation_is_counted():
    model = tiny_llama()
    ids = _ids(1, 16)
    exact = G.exact_generation(model, ids, 5)
    wrong = {**exact, "tokens": [(t + 1) % 100 for t in exact["tokens"]]}
    H.retrofit(model, "softmax")
    g = G.generation_agreement(model, ids, wrong)
    assert g["first_difference"] == 0 and g["free_same"] == 0.0 and g["forced_same"] == 0.0


@pytest.mark.parametrize("method", ["softmax", "linear"])
def test_decoded_losses_equal_one_forward(method):
    """Prefill then one token at a time gives the losses of one causal forward (linear through
    its recurrent state)."""
    model = tiny_llama()
    ids = _ids(1, 30)
    H.retrofit(model, method)
    losses = G.decode_losses(model, ids, H.decoding_cache(model), 6)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, -7:-1].float()
    full = torch.nn.functional.cross_entropy(logits, ids[0, -6:], reduction="none")
    torch.testing.assert_close(losses, full, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="k must be"):
        G.decode_losses(model, ids, None, 30)


def test_decoded_perplexity_of_exact_attention_is_the_models():
    model = tiny_llama()
    ids = _ids(1, 30)
    exact = G.decoded_perplexity(model, ids, 6)
    H.retrofit(model, "softmax")
    row = G.decoded_perplexity(model, ids, 6, exact["ppl"])
    assert exact["ppl"] > 1.0 and row["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
