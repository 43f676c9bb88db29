"""subquad.hf.cache: decoding a retrofitted decoder through the methods' recurrent state."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import subquad.hf as H  # noqa: E402
from test_retrofit import _ids, tiny_gpt2, tiny_llama  # noqa: E402

transformers.logging.set_verbosity_error()


def _cache(cache) -> dict:
    """The cache as a keyword argument under the installed transformers' name for it."""
    return {H.CACHE_ARGUMENT: cache}


STATE = [("linear", {"chunk_size": 4}), ("performer", {"num_features": 32}), ("hedgehog", {"chunk_size": 4})]


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
@pytest.mark.parametrize("method,options", STATE)
def test_prefill_then_steps_equal_the_full_forward(build, method, options):
    """Logits of a prefill and then one token at a time through a StateCache equal one causal
    forward over the whole sequence, and the state's memory does not grow as tokens arrive."""
    model = H.retrofit(build(), method, **options)
    prompt, more = _ids(2, 9), _ids(2, 6, seed=3)
    cache = H.decoding_cache(model)
    assert isinstance(cache, H.StateCache)
    with torch.no_grad():
        full = model(input_ids=torch.cat([prompt, more], 1)).logits
        steps, sizes = [model(input_ids=prompt, **_cache(cache)).logits], []
        for t in range(more.shape[1]):
            steps.append(model(input_ids=more[:, t: t + 1], **_cache(cache)).logits)
            sizes.append(cache.nbytes())
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 15 and len(set(sizes)) == 1 and sizes[0] > 0


@pytest.mark.parametrize("method,options", STATE)
def test_left_padded_batch_prefill_then_steps_equal_the_full_forward(method, options):
    """A batch of two lengths (the shorter left-padded): prefill and single steps through the state
    give the full forward's logits at every real position; padding never enters the state."""
    model = H.retrofit(tiny_llama(), method, **options)
    ids = _ids(2, 14)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = H.decoding_cache(model)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        steps = [model(input_ids=ids[:, :9], attention_mask=mask[:, :9], position_ids=pos[:, :9],
                       **_cache(cache)).logits]
        for t in range(9, 14):
            steps.append(model(input_ids=ids[:, t: t + 1], attention_mask=mask[:, : t + 1],
                               position_ids=pos[:, t: t + 1], **_cache(cache)).logits)
    got = torch.cat(steps, 1)
    torch.testing.assert_close(got[0], full[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, 4:], full[1, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method,options", STATE)
def test_generate_with_state_matches_generate_with_all_keys(method, options):
    """``generate`` with a StateCache gives the tokens of generate with transformers' DynamicCache
    (every key kept, each new query recomputed against all of them), left-padded batch included."""
    model = H.retrofit(tiny_llama(), method, **options)
    ids = _ids(2, 9)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = model.generate(ids, **_cache(H.decoding_cache(model)), **kw)
    want = model.generate(ids, **_cache(transformers.DynamicCache()), **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("method,options", [("sinkhorn", {"block_size": 4}),
                                            ("hedgehog", {"window": 4, "chunk_size": 4})])
def test_methods_without_state_decode_with_all_keys(method, options):
    """A method without a decoding state gets a DynamicCache from decoding_cache, and refuses a
    StateCache with a clear error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sinkhorn says when retrofitted that it cannot decode (test_decoding.py)
        model = H.retrofit(tiny_llama(), method, **options)
    assert not H.has_state(model)
    assert isinstance(H.decoding_cache(model), transformers.DynamicCache)
    with pytest.raises(NotImplementedError, match="no decoding state"), torch.no_grad():
        model(input_ids=_ids(1, 8), **_cache(H.StateCache()))


def test_state_cache_refused_in_exact_mode_and_hooks_removed_by_unretrofit():
    model = H.retrofit(tiny_llama(), "linear")
    H.set_mode(model, "exact")
    with pytest.raises(NotImplementedError, match="approximation"), torch.no_grad():
        model(input_ids=_ids(1, 8), **_cache(H.StateCache()))
    mods = [m for _, m in H.attention_modules(model)]
    H.unretrofit(model)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in mods)


def test_a_state_cache_under_the_other_name_is_refused():
    """Before transformers 5.24 a ``cache=`` keyword reaches the layers beside the model's own
    ``past_key_values`` cache, and would be ignored: the attention module's hook refuses it and
    names the argument to use. (From 5.24 transformers itself renames ``past_key_values``.)"""
    from subquad.hf.retrofit import _remember_cache

    model = H.retrofit(tiny_llama(), "linear")
    module = H.attention_modules(model)[0][1]
    wrong = "past_key_values" if H.CACHE_ARGUMENT == "cache" else "cache"
    with pytest.raises(TypeError, match=f"takes the cache as {H.CACHE_ARGUMENT}="):
        _remember_cache(module, (), {wrong: H.StateCache(), H.CACHE_ARGUMENT: transformers.DynamicCache()})
    state = H.StateCache()
    _remember_cache(module, (), {wrong: state, H.CACHE_ARGUMENT: state})  # one cache under both names
    assert module.subquad_retrofit.active_cache is state


HYBRID_SMALL = {"query_block": 4, "key_block": 2, "num_blocks": 2}


def test_hybrid_selecting_every_block_decodes_exact_attention():
    """hybrid through its decoding state, with blocks enough to cover every key: prefill and
    single steps give the model's own (exact) logits; the state holds the keys, so it grows."""
    model = H.retrofit(tiny_llama(), "hybrid", query_block=4, key_block=2, num_blocks=8)
    exact = H.unretrofit(H.retrofit(tiny_llama(), "linear"))  # the same weights, its own attention
    prompt, more = _ids(2, 9), _ids(2, 6, seed=3)
    cache = H.decoding_cache(model)
    assert isinstance(cache, H.StateCache) and H.has_state(model)
    with torch.no_grad():
        full = exact(input_ids=torch.cat([prompt, more], 1)).logits
        steps, sizes = [model(input_ids=prompt, **_cache(cache)).logits], []
        for t in range(more.shape[1]):
            steps.append(model(input_ids=more[:, t: t + 1], **_cache(cache)).logits)
            sizes.append(cache.nbytes())
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 15 and sizes == sorted(sizes)


def test_hybrid_prefill_is_the_parallel_op_and_a_padded_batch_generates_as_its_rows_alone():
    """With small blocks the prefill's logits are the retrofitted model's full forward, and a
    left-padded batch generates, token for token, what each row generates alone."""
    model = H.retrofit(tiny_llama(), "hybrid", **HYBRID_SMALL)
    ids = _ids(2, 30)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    with torch.no_grad():
        full = model(input_ids=ids[:1]).logits
        pre = model(input_ids=ids[:1], **_cache(H.decoding_cache(model))).logits
    torch.testing.assert_close(pre, full, rtol=1e-5, atol=1e-5)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    both = model.generate(ids, attention_mask=mask, **_cache(H.decoding_cache(model)), **kw)
    for b, start in ((0, 0), (1, 5)):
        alone = model.generate(ids[b: b + 1, start:], **_cache(H.decoding_cache(model)), **kw)
        assert torch.equal(both[b, 30:], alone[0, 30 - start:])


def test_hybrid_decodes_from_a_dynamic_cache_through_its_state_beside_the_keys():
    """Given transformers' DynamicCache (as a model loaded with attn_implementation gets), hybrid
    keeps its decoding state on the cache layers and generates what its own StateCache generates,
    a left-padded batch and beam search (which reorders the cached keys) included."""
    model = H.retrofit(tiny_llama(), "hybrid", **HYBRID_SMALL)
    ids = _ids(2, 30)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    for extra in ({}, {"num_beams": 3}):
        kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **extra)
        keys = model.generate(ids, **_cache(transformers.DynamicCache()), **kw)
        state = model.generate(ids, **_cache(H.decoding_cache(model)), **kw)
        assert torch.equal(keys, state), extra
