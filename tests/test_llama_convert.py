"""``expertcache convert`` for DeepSeek-V3 (``deepseek2``), gpt-oss (``gpt-oss``) and GLM-4-MoE
(``glm4moe``): random small checkpoints (seeded, saved by transformers' ``save_pretrained``)
converted at f32 route every (token, MoE layer) as the Hugging Face model does, the same experts in
the same order, teacher-forced and in a greedy decode; f16 and q8_0 files load and generate; every
refusal is one line; chat templates are carried.

Where llama.cpp's graph differs from transformers' by design, the test says how and bounds it
(``LOGIT_BOUND``, the largest |logit difference| over a teacher-forced 24-token row, measured at a
quarter to a fifth of the bound; the logits of these models are of order 0.5):

* DeepSeek-V3: llama.cpp runs MLA absorbed (``q_nope`` multiplied into the latent space by
  ``attn_k_b``, one latent KV head, ``attn_v_b`` after attention) where transformers decompresses
  ``kv_b_proj`` into per-head keys and values: the same products reassociated, measured 9e-8.
* gpt-oss: llama.cpp always truncates YaRN's correction range (floor/ceil), transformers' gpt-oss
  config says ``truncate: false``, so some rotary frequencies differ (here 1 of 4 pairs, by a
  factor 3; for the real 64-dim head, 9 of 32 pairs, up to 76%): measured 6.8e-6 here (a 6-token
  window, 24 tokens), and 1.2e-7 with ``truncate: true`` (so the sliding window, the attention
  sinks, the interleaved gate/up split and the expert and router biases agree to f32 rounding).
  The difference grows with position and attention sharpness and can move routes:
  :func:`test_gpt_oss_sharp_attention_long_row` gives the numbers.
* GLM-4-MoE: partial rotary (half the head), q/k norms and q/k/v biases: measured 9e-8.

transformers' DeepSeek-V3 and GLM-4-MoE routers take ``torch.topk(..., sorted=False)``; on CPU that
order is descending for k = 2 (the configs here) and not in general for k >= 3, where llama.cpp's
order is still descending and only the sets can be compared. ``expertcache.capture`` records the
HF side for DeepSeek-V3 and GLM-4-MoE; it refuses gpt-oss's experts (biases and a transposed
[E, H, 2I] layout are outside the offload layout), so :func:`hf_routes` records gpt-oss at the same
seam (the experts module's ``top_k_index``/``top_k_weights`` arguments) with hooks.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the llama extra (gguf) is not installed")
torch = pytest.importorskip("torch", reason="torch is needed for the Hugging Face reference")
pytest.importorskip("transformers", reason="transformers is needed for the Hugging Face reference")

from test_llama import hf_capture  # noqa: E402

from expertcache.errors import ConfigError  # noqa: E402
from expertcache.llama.convert import convert  # noqa: E402
from expertcache.formats.gguf import read_geometry  # noqa: E402

# name -> (family, config overrides); "main" cases are the toy configs, the others cover the rest of the mapping
YARN_DS = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {
    "deepseek_v3": ("deepseek_v3", {}),  # q_lora_rank, groups (2, 1 used), 1 dense layer, interleaved rope
    "deepseek_v3_yarn": ("deepseek_v3", dict(rope_interleave=False, q_lora_rank=None, norm_topk_prob=False,
                                             routed_scaling_factor=1.0, rope_parameters=YARN_DS)),
    "gpt_oss": ("gpt_oss", dict(sliding_window=6)),  # YaRN truncate: false (transformers' default)
    "gpt_oss_truncate": ("gpt_oss", dict(sliding_window=6, rope_parameters={
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0})),
    "glm4_moe": ("glm4_moe", dict(use_qk_norm=True, num_key_value_heads=2)),  # partial rotary, q/k/v biases
}
LOGIT_BOUND = {"deepseek_v3": 4e-7, "deepseek_v3_yarn": 4e-7, "gpt_oss": 3e-5, "gpt_oss_truncate": 4e-7,
               "glm4_moe": 4e-7}
WEIGHT_ATOL = 1e-5  # gate weights (after norm / scale), gpt-oss's truncated YaRN included


def _needs_llama():
    return pytest.importorskip("llama_cpp", reason="the llama extra (llama-cpp-python) is not installed")


def build(family: str, folder: Path, seed: int = 5, **overrides) -> Path:
    """A random ``family`` checkpoint (toy sizes) saved by transformers; the selection bias, which
    transformers initializes to zeros, drawn too so that it takes part in the routing."""
    from transformers import AutoModelForCausalLM

    from expertcache.hf.toy import toy_config

    cfg = toy_config(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Each case's checkpoint and its f32 GGUF, built once."""
    root = tmp_path_factory.mktemp("convert")
    made = {}
    for name, (family, over) in CASES.items():
        build(family, root / name, **over)
        convert(root / name, root / f"{name}.gguf", "f32")
        made[name] = (root / name, root / f"{name}.gguf")
    return made


def hf_routes(folder, rows, generate: int = 0):
    """``(experts [T, L, k], weights [T, L, k])`` of every forward position (teacher-forced) or of
    the decode steps only (``generate`` > 0: greedy, the prompt's forward left out), read at the
    experts modules' inputs as ``expertcache.capture`` does."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    forwards: list[dict] = []
    hooks = [model.model.register_forward_pre_hook(lambda *a: forwards.append({}))]
    for name, mod in model.named_modules():
        if name.endswith("mlp.experts"):
            layer = int(name.split(".")[2])
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, layer=layer: forwards[-1].__setitem__(layer, (args[1].clone(), args[2].clone()))))
    kept = []
    with torch.no_grad():
        for r in rows:
            ids = torch.as_tensor(np.asarray(r, dtype=np.int64))[None]
            start = len(forwards)
            if generate:
                model.generate(ids, max_new_tokens=generate, min_new_tokens=generate, do_sample=False)
                kept += forwards[start + 1:]
            else:
                model(ids)
                kept += forwards[start:]
    for h in hooks:
        h.remove()
    layers = sorted(kept[0])
    experts = np.concatenate([np.stack([f[lid][0].numpy() for lid in layers], 1) for f in kept])
    weights = np.concatenate([np.stack([f[lid][1].numpy() for lid in layers], 1) for f in kept])
    return experts, weights


def reference(name, folder, rows, generate=0):
    if CASES[name][0] == "gpt_oss":
        return hf_routes(folder, rows, generate)
    t = hf_capture(folder, rows, generate)
    return t.experts, t.probs


def hf_logits(folder, ids) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]).logits[0].numpy()


def meta(path, key):
    """A metadata value of a GGUF file (strings decoded, arrays as lists), None when absent."""
    f = gguf.GGUFReader(str(path)).fields.get(key)
    if f is None:
        return None
    vals = [f.parts[i] for i in f.data]
    if f.types and f.types[0] == gguf.GGUFValueType.STRING:
        vals = [bytes(v).decode() for v in vals]
    else:
        vals = [v.tolist()[0] for v in vals]
    return vals if f.types and f.types[0] == gguf.GGUFValueType.ARRAY else vals[0]


# ------------------------------------------------------------------------------ routes
@pytest.mark.parametrize("name", list(CASES))
def test_routes_and_logits_equal_hf(ckpts, name):
    """Teacher-forced: same experts in the same order at every (token, MoE layer), gate weights
    within WEIGHT_ATOL, logits within the case's LOGIT_BOUND (see the module docstring)."""
    _needs_llama()
    from expertcache.llama.capture import capture_gguf
    from expertcache.llama.engine import Engine

    folder, path = ckpts[name]
    rows = np.random.default_rng(4).integers(0, 96, size=(2, 24))
    experts, weights = reference(name, folder, rows)
    got = capture_gguf(str(path), rows)
    g = read_geometry(str(path))
    L, k = len(g.moe_layers), g.top_k
    assert got.experts.shape == experts.shape == (48, L, k)
    np.testing.assert_array_equal(got.experts, experts)
    np.testing.assert_allclose(got.probs, weights, atol=WEIGHT_ATOL, rtol=0)
    with Engine(str(path), n_ctx=32) as eng:
        logits = eng.forward(rows[0], logits="all")
    diff = float(np.abs(logits - hf_logits(folder, rows[0])).max())
    assert diff <= LOGIT_BOUND[name], diff


def test_gpt_oss_sharp_attention_long_row(tmp_path):
    """gpt-oss with attention made sharp (q/k weights x8) over 400 tokens, so the 128-token window,
    the sinks and the rotary frequencies all matter: with ``truncate: true`` (llama.cpp's YaRN) every
    route agrees and the logits to f32 rounding (measured 1.8e-7). With transformers' default
    ``truncate: false`` the same model measured a max |logit difference| of 7.4e-2 (logits of order
    0.4) and 28 of the 1200 (token, layer) routes different, the first at position 50: that is the
    design difference, documented, not asserted."""
    _needs_llama()
    from transformers import AutoModelForCausalLM

    from expertcache.llama.capture import capture_gguf
    from expertcache.llama.engine import Engine

    rope = {**CASES["gpt_oss_truncate"][1]["rope_parameters"]}
    build("gpt_oss", tmp_path / "hf", rope_parameters=rope)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "m.gguf", "f32")
    rows = np.random.default_rng(4).integers(0, 96, size=(1, 400))
    experts, weights = hf_routes(tmp_path / "hf", rows)
    got = capture_gguf(str(tmp_path / "m.gguf"), rows, max_len=400)
    np.testing.assert_array_equal(got.experts, experts)
    np.testing.assert_allclose(got.probs, weights, atol=WEIGHT_ATOL, rtol=0)
    with Engine(str(tmp_path / "m.gguf"), n_ctx=400) as eng:
        logits = eng.forward(rows[0], logits="all")
    diff = float(np.abs(logits - hf_logits(tmp_path / "hf", rows[0])).max())
    assert diff <= 1e-6, diff


def test_deepseek_top4_routes_equal_as_sets(tmp_path):
    """k = 4 of 16 experts in 4 groups (2 used): transformers' order is ``torch.topk(sorted=False)``'s
    (not by score), llama.cpp's is by score, so per (token, layer) the expert sets are compared, and
    each expert's gate weight; the orders differ in most rows (measured 96 of 96 here)."""
    _needs_llama()
    from expertcache.llama.capture import capture_gguf

    build("deepseek_v3", tmp_path / "hf", n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    convert(tmp_path / "hf", tmp_path / "m.gguf", "f32")
    rows = np.random.default_rng(4).integers(0, 96, size=(2, 24))
    ref, got = hf_capture(tmp_path / "hf", rows), capture_gguf(str(tmp_path / "m.gguf"), rows)
    assert got.experts.shape == ref.experts.shape == (48, 2, 4)
    a, b = np.argsort(ref.experts, -1), np.argsort(got.experts, -1)
    np.testing.assert_array_equal(np.take_along_axis(ref.experts, a, -1), np.take_along_axis(got.experts, b, -1))
    np.testing.assert_allclose(np.take_along_axis(ref.probs, a, -1), np.take_along_axis(got.probs, b, -1),
                               atol=WEIGHT_ATOL, rtol=0)


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss", "glm4_moe"])
def test_greedy_decode_routes_equal_hf(ckpts, name):
    _needs_llama()
    from expertcache.llama.capture import capture_gguf

    folder, path = ckpts[name]
    rows = np.random.default_rng(6).integers(0, 96, size=(2, 10))
    experts, _ = reference(name, folder, rows, generate=7)
    got = capture_gguf(str(path), rows, generate=7)
    assert got.meta["phase"] == "decode" and got.experts.shape == experts.shape == (12, *experts.shape[1:])
    np.testing.assert_array_equal(got.experts, experts)


def test_gguf_layout(ckpts):
    """What each class's GGUF holds: the keys llama.cpp reads, the expert tensors E-slowest (gpt-oss's
    biases included, split from the interleaved gate_up), dense leading layers outside the experts."""
    from safetensors import safe_open

    ds = ckpts["deepseek_v3"][1]
    g = read_geometry(str(ds))
    assert (g.architecture, g.num_experts, g.top_k, g.moe_layers) == ("deepseek2", 8, 2, [1, 2])
    assert meta(ds, "deepseek2.leading_dense_block_count") == 1
    assert (meta(ds, "deepseek2.expert_group_count"), meta(ds, "deepseek2.expert_group_used_count")) == (2, 1)
    assert meta(ds, "deepseek2.expert_gating_func") == 2 and meta(ds, "deepseek2.expert_weights_norm") is True
    assert meta(ds, "deepseek2.expert_weights_scale") == pytest.approx(2.5)
    assert (meta(ds, "deepseek2.attention.key_length_mla"), meta(ds, "deepseek2.attention.value_length_mla"),
            meta(ds, "deepseek2.attention.key_length"), meta(ds, "deepseek2.attention.head_count_kv")) == (16, 8, 24, 1)
    yarn = ckpts["deepseek_v3_yarn"][1]
    assert meta(yarn, "deepseek2.rope.scaling.type") == "yarn"
    assert meta(yarn, "deepseek2.rope.scaling.yarn_log_multiplier") == pytest.approx(0.1)
    assert meta(yarn, "deepseek2.attention.q_lora_rank") == 0 and meta(yarn, "deepseek2.expert_weights_norm") is False

    oss_dir, oss = ckpts["gpt_oss"]
    assert convert(oss_dir, oss.with_name("again.gguf"))["notes"] == [
        "yarn truncate=false: llama.cpp rounds the correction range [1.01, 2.17] to [1, 3], so some rotary "
        "frequencies differ from transformers' (docs/llama.md, Convert)"]
    assert convert(ckpts["gpt_oss_truncate"][0], oss.with_name("again.gguf"))["notes"] == []
    g = read_geometry(str(oss))
    assert g.architecture == "gpt-oss" and g.moe_layers == [0, 1, 2]
    assert meta(oss, "gpt-oss.attention.sliding_window") == 6
    assert meta(oss, "gpt-oss.attention.sliding_window_pattern") == [True, False, True]
    raw = oss.read_bytes()
    with safe_open(str(oss_dir / "model.safetensors"), "np") as st:
        gu, gub = st.get_tensor("model.layers.1.mlp.experts.gate_up_proj"), st.get_tensor(
            "model.layers.1.mlp.experts.gate_up_proj_bias")
    parts = g.experts[1]
    for e in (0, 5):
        for kind, want in [("ffn_gate_exps.weight", gu[e][:, 0::2].T), ("ffn_up_exps.weight", gu[e][:, 1::2].T),
                           ("ffn_gate_exps.bias", gub[e, 0::2]), ("ffn_up_exps.bias", gub[e, 1::2])]:
            t = parts[kind]
            n = t.nbytes // g.num_experts
            assert raw[t.offset + e * n: t.offset + (e + 1) * n] == np.ascontiguousarray(want, np.float32).tobytes()

    glm = ckpts["glm4_moe"][1]
    g = read_geometry(str(glm))
    assert g.architecture == "glm4moe" and g.moe_layers == [1, 2] and g.skipped_bytes == 0
    assert meta(glm, "glm4moe.rope.dimension_count") == 4 and meta(glm, "glm4moe.attention.key_length") == 8
    assert meta(glm, "glm4moe.nextn_predict_layers") is None  # transformers saves no MTP block


def test_glm_mtp_blocks_are_written_and_skipped(ckpts, tmp_path):
    """A GLM checkpoint with its MTP block (as GLM-4.5's: a decoder layer plus eh_proj, enorm, hnorm,
    shared_head) gets it as block L with ``nextn_predict_layers``; llama.cpp's main graph never runs
    it, so routes are unchanged and the geometry counts it as skipped."""
    _needs_llama()
    from safetensors.numpy import load_file, save_file

    from expertcache.llama.capture import capture_gguf

    src, _ = ckpts["glm4_moe"]
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    L = 3
    base = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(0)
    mtp = {k.replace(f"model.layers.{L - 1}.", f"model.layers.{L}."): v for k, v in base.items()
           if k.startswith(f"model.layers.{L - 1}.")}
    H = base["model.norm.weight"].shape[0]
    mtp.update({f"model.layers.{L}.eh_proj.weight": (rng.standard_normal((H, 2 * H)) * 0.02).astype(np.float32),
                f"model.layers.{L}.enorm.weight": np.ones(H, np.float32),
                f"model.layers.{L}.hnorm.weight": np.ones(H, np.float32),
                f"model.layers.{L}.shared_head.norm.weight": np.ones(H, np.float32)})
    save_file(mtp, str(hf / "mtp.safetensors"))  # not indexed: transformers loads model.safetensors only
    rec = convert(hf, tmp_path / "m.gguf", "f32")
    assert rec["nextn_layers"] == 1
    path = tmp_path / "m.gguf"
    assert meta(path, "glm4moe.nextn_predict_layers") == 1 and meta(path, "glm4moe.block_count") == 4
    g = read_geometry(str(path))
    assert g.moe_layers == [1, 2] and g.skipped_bytes > 0
    rows = np.random.default_rng(4).integers(0, 96, size=(1, 16))
    np.testing.assert_array_equal(capture_gguf(str(path), rows).experts, hf_capture(src, rows).experts)

    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    with pytest.raises(ConfigError, match="holds 1 of the 2 multi-token-prediction blocks"):
        convert(hf, tmp_path / "x.gguf")


def test_packed_experts_layout(ckpts, tmp_path):
    """A state dict saved as the model holds it (``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows
    first) converts to the same tensors as transformers' per-expert checkpoint."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    src, path = ckpts["deepseek_v3"]
    packed = tmp_path / "packed"
    packed.mkdir()
    shutil.copy(src / "config.json", packed / "config.json")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    save_file(sd, str(packed / "model.safetensors"))
    convert(packed, tmp_path / "p.gguf", "f32")
    a, b = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(tmp_path / "p.gguf"))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        np.testing.assert_array_equal(ta.data, tb.data, err_msg=ta.name)


# ------------------------------------------------------------------------------ types
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss", "glm4_moe"])
def test_f16_and_q8_0_load_and_generate(ckpts, tmp_path, name, dtype):
    """Matrices in f16 (q8_0 where a row is a multiple of 32, else f16); routers, norms, the selection
    bias and the expert biases float32; llama.cpp loads the file and greedy-decodes."""
    _needs_llama()
    from expertcache.llama.engine import Engine

    folder, _ = ckpts[name]
    path = tmp_path / f"m-{dtype}.gguf"
    convert(folder, path, dtype)
    g = read_geometry(str(path))
    types = {kind: t.type_name for kind, t in g.experts[g.moe_layers[0]].items()}
    assert types["ffn_gate_exps.weight"] == ("q8_0" if dtype == "q8_0" else "f16")  # rows of H = 32
    assert types["ffn_down_exps.weight"] == "f16"  # rows of I = 16
    assert all(t == "f32" for kind, t in types.items() if kind.endswith(".bias"))
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert kinds[f"blk.{g.moe_layers[0]}.ffn_gate_inp.weight"] == "F32"
    with Engine(str(path), n_ctx=32) as eng:
        tokens, _ = eng.generate(np.arange(1, 9), 6)
    assert len(tokens) == 6 and all(0 <= t < 96 for t in tokens)


# ------------------------------------------------------------------------------ chat template
def test_chat_template_is_written(ckpts, tmp_path):
    """``chat_template.jinja`` first, else ``tokenizer_config.json``'s string or named list; for
    every class (OLMoE here too)."""
    from expertcache.hf.toy import save_toy_checkpoint

    olmoe = save_toy_checkpoint("olmoe", tmp_path / "olmoe", seed=1)
    (olmoe / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))
    assert convert(olmoe, tmp_path / "o.gguf")["chat_template"] is True
    assert meta(tmp_path / "o.gguf", "tokenizer.chat_template") == "{{ messages[0].content }}"
    (olmoe / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    convert(olmoe, tmp_path / "o2.gguf")
    assert meta(tmp_path / "o2.gguf", "tokenizer.chat_template").startswith("{% for m in messages %}")

    glm = tmp_path / "glm"
    shutil.copytree(ckpts["glm4_moe"][0], glm)
    (glm / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}))
    convert(glm, tmp_path / "g.gguf")
    assert meta(tmp_path / "g.gguf", "tokenizer.chat_template") == "D"
    assert meta(tmp_path / "g.gguf", "tokenizer.chat_template.tool_use") == "T"
    assert convert(ckpts["gpt_oss"][0], tmp_path / "n.gguf")["chat_template"] is False
    assert meta(tmp_path / "n.gguf", "tokenizer.chat_template") is None


# ------------------------------------------------------------------------------ refusals
def _yarn(**kw):
    return {**YARN_DS, **kw}


CONFIG_REFUSALS = [
    ("deepseek_v3", {"attention_bias": True}, "attention_bias=true, but llama.cpp's deepseek2 graph has no"),
    ("deepseek_v3", {"n_shared_experts": 0}, "always adds a shared expert"),
    ("deepseek_v3", {"rope_parameters": _yarn(mscale=0.707)}, "only when both are set and equal"),
    ("deepseek_v3", {"rope_parameters": _yarn(beta_fast=16.0)}, "beta_fast=16.0"),
    ("deepseek_v3", {"rope_parameters": _yarn(attention_factor=1.2)}, "attention_factor=1.2"),
    ("deepseek_v3", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("deepseek_v3", {"num_hidden_layers": 27}, "for a 'lite' one without q_lora_rank"),
    ("gpt_oss", {"swiglu_limit": 5.0}, "swiglu_limit=5.0"),
    ("gpt_oss", {"attention_bias": False}, "needs the attention biases"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ("glm4_moe", {"n_shared_experts": 0}, "llama.cpp's glm4moe graph always adds a shared expert"),
    ("glm4_moe", {"n_group": 3}, "n_group=3"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_type='linear'"),
    ("glm4_moe", {"rope_parameters": _yarn(partial_rotary_factor=0.5)}, "does not read them"),
    ("glm4_moe", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "per-layer-type rope parameters"),
    # values of the wrong type or size: each had been exit 70 (ValueError, OverflowError, struct's "argument
    # out of range" as the GGUF was written) or a GGUF written with exit 0 (a negative epsilon, a list read
    # as no rope settings)
    ("gpt_oss", {"swiglu_alpha": "abc"}, "swiglu_alpha 'abc' in config.json is not a finite number"),
    ("gpt_oss", {"sliding_window": 2**40}, "sliding_window '1099511627776' in config.json is not a non-negative "
                                           "integer of at most 4,294,967,295"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": "x"}},
     "rope_parameters.partial_rotary_factor 'x' in config.json is not a finite number"),
    ("glm4_moe", {"rms_norm_eps": -1.0}, "rms_norm_eps '-1.0' in config.json is not within a float32's positive"),
    ("glm4_moe", {"rms_norm_eps": 1e-50}, "rms_norm_eps '1e-50' in config.json is not within"),  # written as 0
    ("deepseek_v3", {"routed_scaling_factor": 10**39}, f"routed_scaling_factor '1{'0' * 39}' in config.json is not "
                                                       "within a float32's positive range"),
    ("deepseek_v3", {"rope_parameters": "yarn"}, "rope_parameters 'yarn' in config.json is not a table"),
    ("deepseek_v3", {"rope_parameters": _yarn(original_max_position_embeddings=2**32)},
     "original_max_position_embeddings '4294967296' in config.json is not a positive integer"),
]


@pytest.mark.parametrize("family,patch,match", CONFIG_REFUSALS, ids=[f"{f}-{m[:24]}" for f, _, m in CONFIG_REFUSALS])
def test_config_refusals(ckpts, tmp_path, family, patch, match):
    bad = tmp_path / "bad"
    shutil.copytree(ckpts[family][0], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **patch}))
    with pytest.raises(ConfigError, match=match) as err:
        convert(bad, tmp_path / "x.gguf")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".*.tmp"))


SMALL = Path(__file__).resolve().parents[1] / "models" / "small-moe"
SMALL_REFUSALS = [  # (file, edit, the one line): each had been exit 70, or a GGUF written with exit 0 that
    # llama.cpp refused, or one whose EOS was llama.cpp's default id 11
    ("config.json", {"num_hidden_layers": None}, "num_hidden_layers is null in config.json"),
    ("config.json", {"max_position_embeddings": None}, "max_position_embeddings is null in config.json"),
    ("config.json", {"vocab_size": 4096}, "vocab_size 4096 in config.json, but model.embed_tokens.weight has shape "
                                          "[2048, 128]"),
    ("config.json", {"num_key_value_heads": 3}, "num_key_value_heads 3 in config.json (x head_dim 32 = 96 rows), "
                                                "but model.layers.0.self_attn.k_proj.weight has 128 rows"),
    ("tokenizer_config.json", "not json", "tokenizer_config.json is not valid JSON"),
    ("tokenizer_config.json", [], "tokenizer_config.json: not a JSON object"),
    ("tokenizer_config.json", {"eos_token": "<|nope|>"}, "eos_token '<|nope|>' is not a token of tokenizer.json"),
    ("tokenizer_config.json", {"eos_token": 5}, "eos_token '5' is not a token"),
    ("tokenizer_config.json", {"add_bos_token": True}, "add_bos_token is true but no bos_token is named"),
    ("tokenizer_config.json", {"chat_template": "{% for m in messages %}{{ m['content'] }"},
     "its chat template does not compile (TemplateSyntaxError"),
    # each of these had been exit 70 (a RecursionError, TypeError or AttributeError), or a GGUF written
    # with exit 0 that dropped what the file said: no vocabulary, no chat template, a string read as true
    ("config.json", "[" * 100_000 + "]" * 100_000, "config.json is nested too deeply to read as JSON"),
    ("config.json", {"model_type": ["olmoe"]}, "model_type ['olmoe'] is not supported by convert"),
    ("config.json", {"norm_topk_prob": "false"}, "norm_topk_prob 'false' in config.json is not true or false"),
    ("config.json", {"bos_token_id": "x"}, "config.json's bos_token_id 'x' is not a token id below vocab_size 2048"),
    ("tokenizer.json", "not json", "tokenizer.json is not valid JSON"),
    ("tokenizer.json", "[" * 100_000 + "]" * 100_000, "tokenizer.json is nested too deeply to read as JSON"),
    ("tokenizer.json", lambda t: t.update(model=5), "tokenizer.json: model '5' is not a table"),
    ("tokenizer.json", lambda t: t["model"]["vocab"].update(zzz=None), "model.vocab gives 'zzz' the id 'None'"),
    ("tokenizer.json", lambda t: t["model"].update(merges="ab"), "model.merges 'ab' is not a list"),
    ("tokenizer.json", lambda t: t["model"]["merges"].append(5), "the merge '5' is neither"),
    ("tokenizer.json", lambda t: t.update(added_tokens=[{"id": 3, "content": None}]), "the added token"),
    ("tokenizer_config.json", {"chat_template": 5}, "chat_template '5' is neither a string nor a list"),
    ("chat_template.jinja", b"\xff{{ messages }}", "chat_template.jinja is not UTF-8 text (byte 0)"),
]


@pytest.mark.parametrize("file,edit,match", SMALL_REFUSALS, ids=[m[:30] for _, _, m in SMALL_REFUSALS])
def test_a_checkpoint_llama_cpp_would_misread_is_refused(tmp_path, file, edit, match):
    if not (SMALL / "config.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    bad = tmp_path / "bad"
    shutil.copytree(SMALL, bad)
    if isinstance(edit, dict) and file == "config.json":
        edit = {**json.loads((bad / file).read_text()), **edit}
    if callable(edit):
        value = json.loads((bad / file).read_text())
        edit(value)
        edit = value
    if isinstance(edit, bytes):
        (bad / file).write_bytes(edit)
    else:
        (bad / file).write_text(edit if isinstance(edit, str) else json.dumps(edit))
    with pytest.raises(ConfigError, match=re.escape(match)) as err:
        convert(bad, tmp_path / "x.gguf", "f16")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".*.tmp"))


def test_special_tokens_the_tokenizer_config_leaves_out_come_from_config_json(tmp_path):
    """A tokenizer_config.json naming no EOS: config.json's eos_token_id (0 for small-moe), not
    llama.cpp's default id 11 (a '+', at which generation would stop)."""
    if not (SMALL / "config.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(SMALL, ckpt)
    (ckpt / "tokenizer_config.json").write_text("{}")
    convert(ckpt, tmp_path / "m.gguf", "f16")
    assert meta(tmp_path / "m.gguf", "tokenizer.ggml.eos_token_id") == 0
    assert meta(tmp_path / "m.gguf", "tokenizer.ggml.bos_token_id") is None  # config.json's is null


def test_a_tokenizer_convert_does_not_write_is_said_and_out_of_range_ids_are_counted(tmp_path):
    """A tokenizer.json of another kind (here a null pre-tokenizer) gives a GGUF that runs on ids,
    and the summary's notes say why; ids at or past vocab_size are left out and counted (both had
    been silent)."""
    if not (SMALL / "config.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(SMALL, ckpt)
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok["model"]["vocab"].update({"zz_past": 2048, "zz_far": 10**6})
    tok["added_tokens"] = (tok.get("added_tokens") or []) + [{"id": 4096, "content": "<|past|>", "special": True}]
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    rec = convert(ckpt, tmp_path / "a.gguf", "f16")
    assert rec["tokenizer"] == "gpt2"
    dropped = "tokenizer.json: 3 token(s) with ids at or past vocab_size 2048 (no embedding row) are left out"
    assert dropped in rec["notes"]
    assert len(meta(tmp_path / "a.gguf", "tokenizer.ggml.tokens")) == 2048
    tok["pre_tokenizer"] = None
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    rec = convert(ckpt, tmp_path / "b.gguf", "f16")
    assert rec["tokenizer"] == "no_vocab" and meta(tmp_path / "b.gguf", "tokenizer.ggml.model") == "no_vocab"
    assert any("tokenizer.json is a BPE model with a None pre-tokenizer, not GPT-2-style byte-level BPE" in n
               for n in rec["notes"])


def test_a_gguf_whose_chat_template_does_not_compile_is_one_line(tmp_path, monkeypatch, capsys):
    """A GGUF from another converter may carry a template that does not compile: llama-cpp-python
    compiles it at load, and every text command had been exit 70 (TemplateSyntaxError)."""
    _needs_llama()
    import expertcache.llama.convert as conv
    from expertcache.cli.main import main

    if not (SMALL / "config.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(SMALL, ckpt)
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    monkeypatch.setattr(conv, "chat_template_problem", lambda template: None)  # as another converter writes it
    convert(ckpt, tmp_path / "m.gguf", "f16")
    monkeypatch.undo()
    for argv in (["llama", "generate", str(tmp_path / "m.gguf"), "--prompt", "hi", "--max-new-tokens", "2"],
                 ["llama", "run", str(tmp_path / "m.gguf"), "--prompt", "hi", "--max-new-tokens", "2",
                  "--no-roofline"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "its tokenizer.chat_template is not a template Jinja compiles" in err[0], err


EXTENDED_TEMPLATE = """{%- for m in messages -%}{%- if m.role == 'stop' -%}{%- break -%}{%- endif -%}
<|{{ m.role }}|>
{% if m.role == 'assistant' -%}{%- generation -%}{{ m.content }}{%- endgeneration %}
{% else %}{{ m.content }}
{% endif %}{%- endfor -%}{%- if add_generation_prompt %}<|assistant|>
{% endif -%}"""
"""A chat template with transformers' two extensions: a ``{% generation %}`` block and ``{% break %}``."""


def test_a_template_with_transformers_extensions_is_converted_and_used(tmp_path, capsys):
    """transformers' ``{% generation %}`` blocks and loop controls compile where llama-cpp-python
    and transformers compile templates (they had been refused: "not a template Jinja compiles");
    llama-cpp-python's prompt is the text transformers renders, with or without llama-cpp-python
    installed for the check."""
    _needs_llama()
    import builtins

    import llama_cpp
    from transformers.utils.chat_template_utils import render_jinja_template

    from expertcache.cli.main import main
    from expertcache.formats.gguf import chat_template_problem

    if not (SMALL / "config.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(SMALL, ckpt)
    (ckpt / "chat_template.jinja").write_text(EXTENDED_TEMPLATE)
    convert(ckpt, tmp_path / "m.gguf", "f16")
    assert main(["llama", "generate", str(tmp_path / "m.gguf"), "--chat", "hi", "--system", "be brief",
                 "--max-new-tokens", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (text,), _ = render_jinja_template([msgs], chat_template=EXTENDED_TEMPLATE, add_generation_prompt=True)
    vocab = llama_cpp.Llama(str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)
    assert got["prompt_tokens"] == len(vocab.tokenize(text.encode(), add_bos=True, special=True))
    real = builtins.__import__

    def without_llama_cpp(name, *args, **kw):
        if name.startswith("llama_cpp"):
            raise ImportError(name)
        return real(name, *args, **kw)

    for importer in (real, without_llama_cpp):
        builtins.__import__ = importer
        try:
            assert chat_template_problem(EXTENDED_TEMPLATE) is None
            assert "endgeneration" in chat_template_problem("{% generation %}unclosed")
        finally:
            builtins.__import__ = real


@pytest.mark.parametrize("edit,match", [
    ("extra", "checkpoint tensor 'model.layers.1.self_attn.kv_b_proj.weight_scale_inv' has no place in a deepseek2"),
    ("missing", r"tensor model.layers.2.mlp.gate.weight is missing \(MoE layer 2\)"),
    ("expert", r"tensor 'model.layers.1.mlp.experts.3.up_proj.weight' is missing"),
])
def test_tensor_refusals(ckpts, tmp_path, edit, match):
    """A tensor the GGUF has no place for (here an FP8 scale) and a missing one are refused: nothing
    the HF model computes with is silently dropped."""
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpts["deepseek_v3"][0], bad)
    sd = load_file(str(bad / "model.safetensors"))
    if edit == "extra":
        sd["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    elif edit == "missing":
        del sd["model.layers.2.mlp.gate.weight"]
    else:
        del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(ConfigError, match=match):
        convert(bad, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".*.tmp"))


def test_bf16_is_read_exactly_and_fp8_is_refused(tmp_path):
    """Released checkpoints of these classes ship in bfloat16: widened exactly; float8 is refused."""
    from safetensors.torch import load_file, save_file

    from expertcache.hf.toy import toy_model

    model = toy_model("glm4_moe", seed=2).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "m.gguf", "f32")
    got = {t.name: t.data for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj.detach().float().numpy()  # [E, 2I, H], gate rows first
    np.testing.assert_array_equal(got["blk.1.ffn_gate_exps.weight"], gate_up[:, :16])
    q_bias = model.model.layers[0].self_attn.q_proj.bias.detach().float().numpy()
    np.testing.assert_array_equal(got["blk.0.attn_q.bias"], q_bias)
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"].to(torch.float8_e4m3fn)
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ConfigError, match="is F8_E4M3, not a float type convert reads"):
        convert(tmp_path / "hf", tmp_path / "x.gguf", "f32")
