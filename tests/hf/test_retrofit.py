"""subquad.hf: retrofit tiny random transformers models (built from configs, nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import subquad  # noqa: E402
import subquad.hf as H  # noqa: E402

transformers.logging.set_verbosity_error()
# a decoder retrofitted with a method that cannot decode from a cache says so (tests/hf/test_decoding.py)
pytestmark = pytest.mark.filterwarnings("ignore:subquad retrofit.*cannot decode from a cache:UserWarning")

QKV_METHODS = [m.name for m in subquad.list_methods() if m.kind == "attention"]
CAUSAL = [m for m in QKV_METHODS if subquad.get_method(m).causal]
# small options so the approximations (not their exact fallbacks) run at the tiny test lengths
OPTIONS = {"nystrom": {"num_landmarks": 4}, "lara": {"num_landmarks": 4}, "performer": {"num_features": 32},
           "sinkhorn": {"block_size": 4}, "linear": {"chunk_size": 4}, "hedgehog": {"chunk_size": 4},
           "hybrid": {"query_block": 4, "key_block": 2, "num_blocks": 1}, "topk": {"top_k": 4},
           "quest": {"page_size": 2, "num_pages": 2}, "moba": {"block_size": 2, "top_blocks": 2},
           "xattention": {"block_size": 4, "stride": 2, "threshold": 0.5},
           "magicpig": {"num_bits": 2, "num_tables": 4, "sinks": 1, "local": 2}}


class WordTokenizer:
    """Enough of a tokenizer for transfer(): one id per word, [CLS]=1 first, [SEP]=2 last."""

    def __call__(self, text, return_tensors="pt", truncation=True, max_length=512, **kwargs):
        ids = [1] + [5 + sum(map(ord, w)) % 90 for w in text.split()][: max_length - 2] + [2]
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}


def tiny_bert(**kw):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=128, **kw)
    return transformers.BertModel(cfg).eval()


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    return transformers.GPT2LMHeadModel(cfg).eval()


TEXTS = ["the quick brown fox jumps over the lazy dog " * 3, "attention is all you need, or so they say " * 4,
         "linear attention replaces the softmax kernel by a feature map", "a b c d e f g h i j k l m n o p"]


def _ids(b=2, n=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 100, (b, n), generator=g)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("build", [tiny_bert, tiny_llama, tiny_gpt2])
def test_softmax_retrofit_is_the_model(build):
    model = build()
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids)[0]
        H.retrofit(model, "softmax")
        out = model(input_ids=ids)[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == "subquad"
    H.unretrofit(model)
    assert model.config._attn_implementation != "subquad"


def test_weights_untouched_bit_identical():
    model = tiny_bert()
    before = _snapshot(model)
    H.retrofit(model, "hedgehog")
    H.transfer(model, TEXTS, WordTokenizer(), steps=3, progress=False)
    with torch.no_grad():
        model(input_ids=_ids())
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    added = set(after) - set(before)
    assert added and all(".subquad_retrofit." in k for k in added)


@pytest.mark.parametrize("method", QKV_METHODS)
def test_zero_shot_encoder_every_method(method):
    """The retrofitted attention is the one that runs (softmax keeps the model's output, every
    approximation moves it), and the tokens at padded positions never reach a real one (the
    global seed fixed before each call, so that ra and lara draw the same samples)."""
    model = tiny_bert()
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 14:] = 0
    ids = _ids()
    other = ids.clone()
    other[1, 14:] = torch.randint(5, 100, (6,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = model(input_ids=ids, attention_mask=mask).last_hidden_state
        H.retrofit(model, method, **OPTIONS.get(method, {}))
        torch.manual_seed(0)
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.manual_seed(0)
        out_other = model(input_ids=other, attention_mask=mask).last_hidden_state
    assert torch.isfinite(out).all()
    real = mask.bool()
    moved = (out - exact)[real].abs().max().item()  # the random model's attention is near uniform: small moves
    assert moved < 1e-6 if method == "softmax" else moved > 2e-5, moved
    torch.testing.assert_close(out_other[1, :14], out[1, :14], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_other[0], out[0], rtol=1e-5, atol=1e-5)


DETERMINISTIC = [m for m in QKV_METHODS if m not in ("ra", "lara")]


@pytest.mark.parametrize("method", DETERMINISTIC)
def test_padded_batch_equals_items_one_by_one(method):
    model = tiny_bert()
    H.retrofit(model, method, **OPTIONS.get(method, {}))
    ids = _ids(3, 24)
    lengths = [24, 17, 9]
    mask = torch.zeros(3, 24, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).last_hidden_state
        for i, n in enumerate(lengths):
            alone = model(input_ids=ids[i: i + 1, :n]).last_hidden_state
            torch.testing.assert_close(batch[i, :n], alone[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", CAUSAL)
@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
def test_decoder_causal_no_leak(build, method):
    model = build()
    H.retrofit(model, method, **OPTIONS.get(method, {}))
    ids = _ids(2, 24)
    other = ids.clone()
    other[:, 13:] = torch.randint(5, 100, other[:, 13:].shape, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, model(input_ids=other).logits
    torch.testing.assert_close(a[:, :13], b[:, :13], rtol=0, atol=1e-5)
    assert (a[:, 13:] - b[:, 13:]).abs().max() > 1e-4  # the future does matter where it should


@pytest.mark.parametrize("method", CAUSAL)
def test_decoder_left_padding_matches_unpadded(method):
    model = tiny_llama()
    H.retrofit(model, method, **OPTIONS.get(method, {}))
    ids = _ids(1, 16)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 16, dtype=torch.long)], 1)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        alone = model(input_ids=ids).logits
        batch = model(input_ids=padded, attention_mask=mask, position_ids=pos).logits
    if method == "sinkhorn":  # blocks are cut at different places once 5 pad tokens shift the sequence
        assert torch.isfinite(batch).all()
        return
    torch.testing.assert_close(batch[:, 5:], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method,options", [("hedgehog", {"chunk_size": 4}), ("hedgehog", {"window": 4, "sinks": 1}),
                                            ("linear", {"chunk_size": 4}), ("performer", {"num_features": 32})])
def test_cached_generation_matches_full_forward(method, options):
    model = tiny_llama()
    H.retrofit(model, method, **options)
    prompt = _ids(1, 6)
    got = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    x = prompt
    with torch.no_grad():
        for _ in range(6):
            x = torch.cat([x, model(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, x)


@pytest.mark.parametrize("method", sorted(set(QKV_METHODS) - set(CAUSAL)))
def test_non_causal_method_refused_on_decoder(method):
    model = tiny_llama()
    with pytest.raises(NotImplementedError, match="not causal"):
        H.retrofit(model, method)
    assert model.config._attn_implementation != "subquad"
    assert not any(hasattr(m, "subquad_retrofit") for m in model.modules())


def test_unknown_method_and_option_refused():
    with pytest.raises(ValueError, match="unknown retrofit method"):
        H.retrofit(tiny_bert(), "hamburger")
    with pytest.raises(ValueError, match="unknown option"):
        H.retrofit(tiny_bert(), "nystrom", landmarks=3)
    with pytest.raises(ValueError, match="unknown option"):
        H.retrofit(tiny_bert(), "hedgehog", window_size=3)
    with pytest.raises(TypeError):
        H.retrofit(torch.nn.Linear(2, 2), "linear")
    model = tiny_bert()
    H.retrofit(model, "linear")
    with pytest.raises(ValueError, match="already retrofitted"):
        H.retrofit(model, "linear")


def test_custom_4d_mask_refused():
    model = tiny_bert()
    H.retrofit(model, "nystrom", num_landmarks=4)
    mask4 = torch.zeros(2, 1, 20, 20)
    with pytest.raises(NotImplementedError, match="2-D padding masks"):
        with torch.no_grad():
            model(input_ids=_ids(), attention_mask=mask4)


def test_sliding_window_pattern_refused():
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    model = transformers.MistralForCausalLM(cfg).eval()
    H.retrofit(model, "linear")
    with pytest.raises(NotImplementedError):
        with torch.no_grad():
            model(input_ids=_ids(1, 12))


@pytest.mark.parametrize("method,options", [("hedgehog", {}), ("hedgehog", {"window": 3, "sinks": 1}),
                                            ("nystrom", {"num_landmarks": 4}), ("linear", {})])
def test_transfer_lowers_layer_loss(method, options):
    model = tiny_bert(initializer_range=0.3)  # sharper attention than the default init's near-uniform one
    H.retrofit(model, method, **options)
    res = H.transfer(model, TEXTS, WordTokenizer(), steps=15, lr=3e-2, batch_size=2, progress=False)
    assert len(res["loss_before"]) == 2
    assert sum(res["loss_after"]) < sum(res["loss_before"])
    assert res["parameters"] > 0


def test_transfer_resumes_from_checkpoint(tmp_path):
    tok = WordTokenizer()
    straight = tiny_bert()
    H.retrofit(straight, "hedgehog")
    H.transfer(straight, TEXTS, tok, steps=4, batch_size=2, progress=False)
    ckpt = tmp_path / "ckpt.pt"
    part = tiny_bert()
    H.retrofit(part, "hedgehog")
    H.transfer(part, TEXTS, tok, steps=2, batch_size=2, checkpoint=ckpt, checkpoint_every=2, progress=False)
    resumed = tiny_bert()
    H.retrofit(resumed, "hedgehog")
    res = H.transfer(resumed, TEXTS, tok, steps=4, batch_size=2, checkpoint=ckpt, progress=False)
    assert res["resumed_from"] == 2
    for a, b in zip(H.trainable_parameters(straight), H.trainable_parameters(resumed)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("method,options", [("hedgehog", {"window": 2, "sinks": 1}),
                                            ("performer", {"num_features": 16}), ("nystrom", {"num_landmarks": 4})])
def test_save_load_round_trip(tmp_path, method, options):
    model = tiny_bert()
    H.retrofit(model, method, **options)
    H.transfer(model, TEXTS, WordTokenizer(), steps=3, batch_size=2, progress=False)
    path = H.save_retrofit(model, tmp_path / "r.pt", meta={"note": "test"})
    state = torch.load(path, weights_only=True)
    assert state["method"] == method and state["meta"] == {"note": "test"}
    pretrained = set(tiny_bert().state_dict())
    for layer in state["layers"].values():
        assert not set(layer) & pretrained
    fresh = tiny_bert()
    H.load_retrofit(fresh, path)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state,
                                   rtol=0, atol=0)


def test_load_refuses_other_files(tmp_path):
    torch.save({"format": "nope"}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not a subquad retrofit"):
        H.load_retrofit(tiny_bert(), tmp_path / "x.pt")
    model = tiny_bert()
    H.retrofit(model, "linear")
    H.save_retrofit(model, tmp_path / "bert.pt")
    with pytest.raises(ValueError, match="attention modules"):
        H.load_retrofit(tiny_llama(), tmp_path / "bert.pt")


def test_embedding_agreement_and_compare():
    a = torch.randn(6, 8)
    res = H.embedding_agreement(a, a)
    assert res["mean_cosine"] == pytest.approx(1.0) and res["nn_agreement"] == 1.0
    model = tiny_bert()
    H.retrofit(model, "softmax")
    out = H.compare_to_exact(model, _BatchTokenizer(), TEXTS)
    assert out["min_cosine"] > 0.99999


class _BatchTokenizer(WordTokenizer):
    """Padded batches of word ids, for embed()."""

    def __call__(self, texts, return_tensors="pt", padding=True, truncation=True, max_length=512, **kw):
        if isinstance(texts, str):
            return super().__call__(texts, max_length=max_length)
        rows = [super(_BatchTokenizer, self).__call__(t, max_length=max_length)["input_ids"][0] for t in texts]
        n = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), n, dtype=torch.long)
        mask = torch.zeros(len(rows), n, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
            mask[i, : len(r)] = 1
        return {"input_ids": ids, "attention_mask": mask}
