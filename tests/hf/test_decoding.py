"""Retrofitted decoders generate with no extra argument, and reload through transformers' own
``attn_implementation`` switch (subquad.hf.decoding, subquad.hf.interface)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import subquad.hf as H  # noqa: E402
from test_retrofit import CAUSAL, OPTIONS, QKV_METHODS, _ids, tiny_gpt2, tiny_llama  # noqa: E402

transformers.logging.set_verbosity_error()

# how each shipped causal method decodes (a method added later is checked against its own kind)
KINDS = {"softmax": "keys", "linear": "state", "performer": "state", "hedgehog": "state", "hybrid": "state",
         "sinkhorn": "none"}


def _retrofit(method, build=tiny_llama, **options):
    """Retrofit; a method that cannot decode warns, and only such a method."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = H.retrofit(build(), method, **OPTIONS.get(method, {}), **options)
    kind = H.decoding_kind(model)
    assert kind == KINDS.get(method, kind)
    assert any("cannot decode from a cache" in str(w.message) for w in caught) == (kind == "none")
    return model


def _explicit(model) -> dict:
    """The decoding arguments a user had to pass before: the method's cache, or no cache at all."""
    return {"use_cache": False} if H.decoding_kind(model) == "none" else {H.CACHE_ARGUMENT: H.decoding_cache(model)}


def test_the_shipped_methods_decoding_kinds():
    assert set(KINDS) <= set(CAUSAL)
    assert H.decoding_kind(H.retrofit(tiny_llama(), "hedgehog", window=4)) == "keys"


@pytest.mark.parametrize("method", CAUSAL)
def test_plain_generate_equals_the_explicit_cache_path(method):
    """``model.generate(ids)`` with nothing else gives the tokens of the path with the method's
    own cache passed by hand, on a left-padded batch."""
    model = _retrofit(method)
    ids = _ids(2, 11)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, **_explicit(model), **kw))


@pytest.mark.filterwarnings("ignore:`past_key_values`")  # from transformers 5.24 named cache=; the old name still works
@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
@pytest.mark.parametrize("method", CAUSAL)
def test_manual_cached_steps_use_the_methods_cache(build, method):
    """``out = model(ids, use_cache=True)`` returns the method's cache (a StateCache for a method
    with a decoding state), and single steps fed ``out.past_key_values`` give generate's tokens."""
    model = _retrofit(method, build)
    if H.decoding_kind(model) == "none":
        pytest.skip(f"{method} cannot decode from a cache")
    ids = _ids(1, 10)
    want = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        assert isinstance(cache, H.StateCache) == (H.decoding_kind(model) == "state")
        tokens = [ids]
        for _ in range(5):
            tokens.append(out.logits[:, -1:].argmax(-1))
            out = model(tokens[-1], past_key_values=out.past_key_values)
    assert torch.equal(torch.cat(tokens, 1), want)
    assert cache.get_seq_length() == 15


def test_a_method_that_cannot_decode_says_so_at_retrofit_time():
    """sinkhorn warns when it is retrofitted and switches the cache off, so generate recomputes
    the prefix instead of failing mid-generation; unretrofit switches it back."""
    model = tiny_llama()
    with pytest.warns(UserWarning, match="'sinkhorn' cannot decode from a cache"):
        H.retrofit(model, "sinkhorn", block_size=4)
    assert model.config.use_cache is False and model.generation_config.use_cache is False
    out = model.generate(_ids(1, 9), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 12)
    H.unretrofit(model)
    assert model.config.use_cache is True and model.generation_config.use_cache is True


def test_exact_mode_and_training_keep_transformers_cache():
    """No StateCache while the layers run exact attention or the model trains; unretrofit removes
    the hook, the generate wrapper and the config fields."""
    model = H.retrofit(tiny_llama(), "linear", chunk_size=4)
    ids = _ids(1, 8)
    with torch.no_grad():
        assert isinstance(model(ids).past_key_values, H.StateCache)
        H.set_mode(model, "exact")
        assert isinstance(model(ids).past_key_values, transformers.DynamicCache)
        H.set_mode(model, "approx")
        model.train()
        assert not isinstance(model(ids).past_key_values, H.StateCache)
    model.eval()
    assert model.config.subquad_method == "linear" and model.config.subquad_options == {"chunk_size": 4}
    H.unretrofit(model)
    assert "_prepare_cache_for_generation" not in model.__dict__ and not model.model._forward_pre_hooks
    assert not hasattr(model.config, "subquad_method") and not hasattr(model.config, "subquad_options")
    with torch.no_grad():
        assert isinstance(model(ids).past_key_values, transformers.DynamicCache)


# ----------------------------------------------------------------------------- attn_implementation


@pytest.mark.parametrize("method", ["hybrid", "linear", "performer"])
def test_save_pretrained_reloads_with_attn_implementation(tmp_path, method):
    """A retrofitted tiny Llama saved with subquad.hf.save_pretrained and reloaded by
    ``AutoModelForCausalLM.from_pretrained(dir, attn_implementation="subquad_<method>")`` computes
    the same logits and generates the same tokens; the directory holds no retrofit tensors."""
    assert f"subquad_{method}" in H.register_attention()
    model = _retrofit(method, seed=3)
    H.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["subquad_method"] == method and config["subquad_options"] == {**OPTIONS[method], "seed": 3}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=f"subquad_{method}")
    loaded.eval()
    assert not any(".subquad_retrofit." in k for k in loaded.state_dict())
    ids = _ids(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert all(hasattr(m, "subquad_retrofit") for _, m in H.attention_modules(loaded))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(ids, **kw), model.generate(ids, **kw))


def test_attn_implementation_takes_options_from_the_config():
    """``subquad_options`` apply to the method ``subquad_method`` names (or any, without one); a
    non-causal method is refused on a decoder at its first call."""
    H.register_attention()
    model = tiny_llama()
    model.config.subquad_options = {"num_blocks": 2, "key_block": 4}
    model.set_attn_implementation("subquad_hybrid")
    with torch.no_grad():
        model(_ids(1, 20))
    r = H.attention_modules(model)[0][1].subquad_retrofit
    assert r.method == "hybrid" and r.options == {"num_blocks": 2, "key_block": 4}
    model.config.subquad_method = "hybrid"  # hybrid's options: linear runs with its defaults
    model.set_attn_implementation("subquad_linear")
    with torch.no_grad():
        model(_ids(1, 20))
    r = H.attention_modules(model)[0][1].subquad_retrofit
    assert r.method == "linear" and r.options == {}
    non_causal = sorted(set(QKV_METHODS) - set(CAUSAL))[0]
    other = tiny_llama()
    other.set_attn_implementation(f"subquad_{non_causal}")
    with pytest.raises(NotImplementedError, match="not causal"), torch.no_grad():
        other(_ids(1, 8))


def test_save_pretrained_refuses_trained_tensors(tmp_path):
    model = H.retrofit(tiny_llama(), "linear", adapter=True)
    with torch.no_grad():
        H.attention_modules(model)[0][1].subquad_retrofit.q_adapter.mul_(2)
    with pytest.raises(ValueError, match="save_retrofit"):
        H.save_pretrained(model, tmp_path)
    with pytest.raises(ValueError, match="retrofitted"):
        H.save_pretrained(tiny_llama(), tmp_path)


def test_save_pretrained_writes_a_gguf_read_model_whose_weights_were_unpacked(tmp_path):
    """A model read from a GGUF file and unpacked to plain weights at load (SmolLM2 by
    subquad.data.pretrained.load_smollm) is saved as an ordinary model; its quantizer is put back after."""
    import types

    model = H.retrofit(tiny_llama(), "linear")
    quantizer = types.SimpleNamespace(quantization_config=types.SimpleNamespace(quant_method="gguf"),
                                      packed_modules={})
    model.hf_quantizer = quantizer
    H.save_pretrained(model, tmp_path / "plain")
    assert model.hf_quantizer is quantizer
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    quantizer.packed_modules = {"model.layers.0.mlp.up_proj": None}  # weights still in GGUF blocks: refused
    with pytest.raises(ValueError, match="not serializable"):
        H.save_pretrained(model, tmp_path / "packed")
