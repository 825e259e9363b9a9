"""llama.cpp as an engine (docs/llama.md): GGUF geometry and refusals, HF -> GGUF conversion, and
routing captured from llama.cpp equal to the Hugging Face capture of the same ids, exactly.

Needs the llama extra (llama-cpp-python, gguf) and torch/transformers for the reference; skips
with the reason otherwise. Models are tiny (a random OLMoE of 3 layers, models/small-moe).
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the llama extra (gguf) is not installed")
torch = pytest.importorskip("torch", reason="torch is needed for the Hugging Face reference")
pytest.importorskip("transformers", reason="transformers is needed for the Hugging Face reference")

import expertcache  # noqa: E402
from expertcache.errors import ConfigError  # noqa: E402
from expertcache.llama.convert import convert  # noqa: E402
from expertcache.formats.gguf import READ, TESTED, read_geometry  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "models" / "small-moe"


def _needs_llama():
    return pytest.importorskip("llama_cpp", reason="the llama extra (llama-cpp-python) is not installed")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A random OLMoE checkpoint (3 layers, 8 experts, top-2) and its f32 and f16 GGUFs."""
    from expertcache.hf.toy import save_toy_checkpoint

    d = tmp_path_factory.mktemp("toy")
    save_toy_checkpoint("olmoe", d / "hf", seed=3)
    convert(d / "hf", d / "f32.gguf", "f32")
    convert(d / "hf", d / "f16.gguf", "f16")
    return d


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    if not (SMALL / "config.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    out = tmp_path_factory.mktemp("small") / "small-moe-f32.gguf"
    rec = convert(SMALL, out, "f32")
    assert rec["tokenizer"] == "gpt2"
    return out


def hf_capture(folder, rows, generate: int = 0):
    from expertcache.hf import load_model

    torch.set_num_threads(1)
    model = load_model(str(folder), dtype="float32").eval()
    phase = "auto" if generate else "all"
    with torch.no_grad(), expertcache.capture(model, phase=phase) as cap:
        for r in rows:
            ids = torch.as_tensor(np.asarray(r, dtype=np.int64))[None]
            if generate:
                model.generate(ids, max_new_tokens=generate, min_new_tokens=generate, do_sample=False)
            else:
                model(ids)
    return cap.trace


# ------------------------------------------------------------------------------ geometry
def test_the_architecture_lists_are_gguf_moe_architectures():
    """Every architecture read is one whose tensor table in the gguf package has routed experts."""
    exp = {gguf.MODEL_TENSOR.FFN_GATE_EXP, gguf.MODEL_TENSOR.FFN_UP_EXP, gguf.MODEL_TENSOR.FFN_DOWN_EXP,
           gguf.MODEL_TENSOR.FFN_GATE_UP_EXP}
    moe = {gguf.MODEL_ARCH_NAMES[a] for a, ts in gguf.MODEL_TENSORS.items() if exp & set(ts)}
    assert set(TESTED) | set(READ) <= moe and not set(TESTED) & set(READ)
    assert moe - set(TESTED) - set(READ) == {"nomic-bert-moe", "llama-embed", "grovemoe"}  # refused, see geometry


@pytest.mark.parametrize("dtype,np_dtype", [("f32", np.float32), ("f16", np.float16)])
def test_expert_ranges_are_the_checkpoint_experts(toy, dtype, np_dtype):
    """Each expert's gate/up/down byte ranges in the GGUF hold exactly that expert's HF tensors."""
    from safetensors import safe_open

    g = read_geometry(str(toy / f"{dtype}.gguf"))
    assert (g.architecture, g.num_experts, g.top_k, g.moe_layers) == ("olmoe", 8, 2, [0, 1, 2])
    raw = (toy / f"{dtype}.gguf").read_bytes()
    with safe_open(str(toy / "hf" / "model.safetensors"), "np") as st:
        for layer in g.moe_layers:
            for e in range(g.num_experts):
                for (off, n), proj in zip(g.expert_ranges(layer, e), ("gate_proj", "up_proj", "down_proj")):
                    want = st.get_tensor(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight").astype(np_dtype)
                    assert raw[off:off + n] == want.tobytes()
    assert g.uniform_expert_bytes == 3 * 16 * 32 * np.dtype(np_dtype).itemsize
    assert g.expert_tensor_bytes == 3 * 8 * g.uniform_expert_bytes
    assert g.dense_bytes == g.file_bytes - g.expert_tensor_bytes and g.skipped_bytes == 0


def test_refusals(toy, tmp_path):
    good = (toy / "f32.gguf").read_bytes()
    cases = {"notgguf.gguf": b"PK\x03\x04" + b"\0" * 64, "short.gguf": good[:100], "cut.gguf": good[: len(good) - 10],
             "huge.gguf": b"GGUF" + struct.pack("<IQQ", 3, 2**40, 1) + b"\0" * 16}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        read_geometry(str(tmp_path / "notgguf.gguf"))
    with pytest.raises(ConfigError, match="truncated"):
        read_geometry(str(tmp_path / "short.gguf"))
    with pytest.raises(ConfigError, match="truncated file"):
        read_geometry(str(tmp_path / "cut.gguf"))
    with pytest.raises(ConfigError, match="more than the"):
        read_geometry(str(tmp_path / "huge.gguf"))
    (tmp_path / "head.gguf").write_bytes(good[:20])  # the magic, then less than a header: was "no GGUF magic"
    with pytest.raises(ConfigError, match=r"truncated GGUF file \(20 bytes: its header alone is 24\)"):
        read_geometry(str(tmp_path / "head.gguf"))
    dense = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(dense), "llama")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match="not a mixture-of-experts"):
        read_geometry(str(dense))
    other = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(other), "nomic-bert-moe")  # an embedding model: no decode to serve
    w.add_block_count(1), w.add_expert_count(4), w.add_expert_used_count(2)
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((4, 4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match="architecture 'nomic-bert-moe' is not read by expertcache"):
        read_geometry(str(other))
    wrong = tmp_path / "wrong.gguf"  # an expert tensor whose slowest dimension is not E
    w = gguf.GGUFWriter(str(wrong), "olmoe")
    w.add_block_count(1), w.add_expert_count(4), w.add_expert_used_count(2)
    w.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((3, 4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match="slowest dimension is not the 4 experts"):
        read_geometry(str(wrong))


def test_convert_refusals(toy, tmp_path):
    import json
    import shutil

    bad = tmp_path / "norm"
    shutil.copytree(toy / "hf", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": True}))
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        convert(bad, tmp_path / "x.gguf")
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="not supported by convert"):
        convert(bad, tmp_path / "x.gguf")
    # values of the wrong type are named before anything is written (they were a TypeError, or a
    # GGUF with a NaN rope base that llama.cpp computes nothing with)
    for change, match in [({"hidden_size": "128"}, "hidden_size '128' in config.json is not a positive integer"),
                          ({"num_experts_per_tok": 0}, "num_experts_per_tok '0' in config.json is not a positive"),
                          ({"rms_norm_eps": float("nan")}, "rms_norm_eps 'nan' in config.json is not a finite"),
                          # an integer beyond any float was an OverflowError (an internal error)
                          ({"rope_theta": 10**400}, "rope_theta '1" + "0" * 59 + "' in config.json is not a finite")]:
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConfigError, match=match):
            convert(bad, tmp_path / "x.gguf")
    # a safetensors file whose header lies (a tensor's offsets past its data) is one line
    (bad / "config.json").write_text(json.dumps(cfg))
    weights = next(bad.glob("*.safetensors"))
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ConfigError, match="not a safetensors file convert can read"):
        convert(bad, tmp_path / "x.gguf")
    assert not list(tmp_path.glob(".*.tmp")) and not (tmp_path / "x.gguf").exists()


def test_layout_check_and_struct_refusal(monkeypatch):
    _needs_llama()
    from expertcache.llama import ggml

    assert ggml.check_layout() == "0.3.36"
    monkeypatch.setattr(ggml, "_checked", None)
    monkeypatch.setattr(ggml, "GGML_OBJECT_SIZE", 40)  # as if the library's struct were 8 bytes shorter
    with pytest.raises(ConfigError, match="another layout"):
        ggml.check_layout()


# ------------------------------------------------------------------------------ capture
def test_capture_teacher_forced_equals_hf(toy):
    """Same experts in the same order at every (token, layer), the last layer included; gate weights agree."""
    _needs_llama()
    from expertcache.llama.capture import capture_gguf

    rows = np.random.default_rng(0).integers(0, 96, size=(2, 24))
    ref, got = hf_capture(toy / "hf", rows), capture_gguf(str(toy / "f32.gguf"), rows)
    assert got.meta["phase"] == "teacher-forced" and got.meta["engine"] == "llama.cpp"
    assert got.meta["expert_bytes"] == read_geometry(str(toy / "f32.gguf")).uniform_expert_bytes
    assert got.experts.shape == ref.experts.shape == (48, 3, 2)
    np.testing.assert_array_equal(got.experts, ref.experts)
    np.testing.assert_array_equal(got.seq, ref.seq)
    np.testing.assert_allclose(got.probs, ref.probs, atol=1e-5)


def test_capture_decode_equals_hf(toy):
    _needs_llama()
    from expertcache.llama.capture import capture_gguf

    rows = np.random.default_rng(1).integers(0, 96, size=(2, 12))
    ref, got = hf_capture(toy / "hf", rows, generate=9), capture_gguf(str(toy / "f32.gguf"), rows, generate=9)
    assert got.meta["phase"] == ref.meta["phase"] == "decode"
    assert got.experts.shape == (16, 3, 2)
    np.testing.assert_array_equal(got.experts, ref.experts)


def test_capture_keeps_the_prompt_as_llama_cpp_routed_it(toy):
    """``keep_prompt``: each generation's prompt forward is kept and flagged; its rows equal a
    teacher-forced capture of the same ids at every MoE layer but the last, where llama.cpp routed
    the output row only (the others -1); the decode rows equal a plain ``generate`` capture's."""
    _needs_llama()
    from expertcache.llama.capture import capture_gguf

    path = str(toy / "f32.gguf")
    rows = np.random.default_rng(1).integers(0, 96, size=(2, 12))
    got = capture_gguf(path, rows, generate=9, keep_prompt=True)
    flags = got.extras["prefill"]
    assert got.meta["phase"] == "mixed" and got.experts.shape == (24 + 16, 3, 2)
    np.testing.assert_array_equal(flags, np.r_[np.ones(12), np.zeros(8), np.ones(12), np.zeros(8)])
    np.testing.assert_array_equal(got.experts[flags == 0], capture_gguf(path, rows, generate=9).experts)
    forced = capture_gguf(path, rows).experts  # every row's logits: every row routes at every layer
    prompt = got.experts[flags == 1]
    np.testing.assert_array_equal(prompt[:, :-1], forced[:, :-1])
    last = prompt[:, -1].reshape(2, 12, 2)
    assert (last[:, :-1] == -1).all()
    np.testing.assert_array_equal(last[:, -1], forced[:, -1].reshape(2, 12, 2)[:, -1])
    assert np.array_equal(got.seq, np.repeat([0, 1], 20))


def test_small_moe_capture_equals_hf(small_gguf):
    _needs_llama()
    from expertcache.llama.capture import capture_gguf

    rows = np.load(SMALL / "heldout_ids.npy")[:2, :48]
    np.testing.assert_array_equal(capture_gguf(str(small_gguf), rows).experts, hf_capture(SMALL, rows).experts)
    np.testing.assert_array_equal(capture_gguf(str(small_gguf), rows[:, :16], generate=8).experts,
                                  hf_capture(SMALL, rows[:, :16], generate=8).experts)


def test_python_capture_takes_a_llama_engine(toy):
    _needs_llama()
    from expertcache.llama.engine import Engine

    ids = np.arange(1, 11)
    with Engine(str(toy / "f32.gguf"), n_ctx=16) as eng:
        with expertcache.capture(eng, phase="all") as cap:
            eng.forward(ids, logits="all")
        assert cap.trace.experts.shape == (10, 3, 2)
        with expertcache.capture(eng, phase="all") as short:
            eng.reset()
            eng.forward(ids, logits="last")  # the last layer then routes one row only: refused
        with pytest.raises(ConfigError, match="last row"):
            short.trace
        with pytest.raises(ConfigError, match="outside the model's vocabulary"):
            eng.forward([96])



def test_an_engine_checks_its_arguments(toy):
    """ctypes had cut n_ctx=2**32 + 5 to 5 and threads=10**30 to its low bits without a word; 2.5
    was truncated, 0 and -1 taken; a path of True had been opened as file descriptor 1 (stdout)."""
    _needs_llama()
    from expertcache.errors import max_threads
    from expertcache.llama.engine import MAX_CONTEXT, Engine

    path = str(toy / "f32.gguf")
    for n_ctx in (0, -1, 2.5, True, 2**32 + 5, MAX_CONTEXT + 1, None):
        with pytest.raises(ConfigError, match="n_ctx must be an integer in"):
            Engine(path, n_ctx=n_ctx)
    for threads in (0, -1, 2.5, True, 10**30, max_threads() + 1):
        with pytest.raises(ConfigError, match="threads must be an integer in"):
            Engine(path, threads=threads)
    for bad in (True, 7, None):
        with pytest.raises(ConfigError, match="expected a file name"):
            Engine(bad)
    with Engine(path, n_ctx=np.int64(16), threads=np.int64(1)) as eng:
        assert (eng.n_ctx, eng.threads) == (16, 1)


# ------------------------------------------------------------------------------ CLI
def cli(*argv):
    return subprocess.run([sys.executable, "-m", "expertcache.cli.main", *map(str, argv)], capture_output=True,
                          text=True, cwd=REPO, timeout=600)


def test_cli_convert_capture_and_hostile_inputs(toy, tmp_path):
    _needs_llama()
    np.save(tmp_path / "ids.npy", np.random.default_rng(2).integers(0, 96, size=(2, 16)))
    np.save(tmp_path / "bad_ids.npy", np.array([[1, 2, 500]]))
    out = cli("convert", toy / "hf", "--out", tmp_path / "m.gguf", "--dtype", "q8_0", "--json")
    assert out.returncode == 0, out.stderr
    g = read_geometry(str(tmp_path / "m.gguf"))  # gate/up rows of 32 quantize; down's rows of 16 stay f16
    parts = g.experts[0]
    assert (parts["ffn_gate_exps.weight"].type_name, parts["ffn_down_exps.weight"].type_name) == ("q8_0", "f16")
    done = cli("capture", "--model", toy / "f32.gguf", "--tokens", tmp_path / "ids.npy", "--out", tmp_path / "t.npz")
    assert done.returncode == 0, done.stderr
    t = expertcache.load_trace(tmp_path / "t.npz")
    assert t.meta["engine"] == "llama.cpp" and t.experts.shape == (32, 3, 2)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 30)
    for argv, match in [
        (("llama", "info", tmp_path / "ids.npy"), "not a GGUF file"),
        (("llama", "info", tmp_path / "junk.gguf"), "GGUF"),
        (("capture", "--model", toy / "f32.gguf", "--tokens", tmp_path / "bad_ids.npy", "--out", tmp_path / "b.npz"),
         "outside the model's vocabulary"),
        (("capture", "--model", toy / "f32.gguf", "--tokens", tmp_path / "ids.npy", "--out", tmp_path / "b.npz",
          "--router-probs"), "--router-probs: not supported"),
        (("capture", "--model", toy / "f32.gguf", "--tokens", tmp_path / "ids.npy", "--out", tmp_path / "b.npz",
          "--dtype", "float16"), "--dtype: not supported"),  # was ignored
        (("capture", "--model", toy / "f32.gguf", "--tokens", tmp_path / "ids.npy", "--out", tmp_path / "b.npz",
          "--generate", "1"), "--generate 1: no decode step to capture"),  # was llama.cpp's internal message
        (("capture", "--model", toy / "f32.gguf", "--tokens", tmp_path / "ids.npy", "--out", tmp_path / "b.npz",
          "--generate", str(2**62)), "needs a context of"),  # was "llama_decode failed with status 1"
        (("convert", tmp_path, "--out", tmp_path / "x.gguf"), "cannot read config.json"),
        (("llama", "run", toy / "f32.gguf", "--tokens", tmp_path / "ids.npy", "--memory-wall", "lots"), "--memory-wall"),
    ]:
        done = cli(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and match in lines[0], (argv, done.stderr)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_other_families_route_as_hf(family, tmp_path):
    """Qwen2-MoE (shared expert), Qwen3-MoE (normalized top-k) and Mixtral (permuted q/k) convert
    and route as transformers does, teacher-forced."""
    _needs_llama()
    from transformers import AutoModelForCausalLM

    from expertcache.llama.capture import capture_gguf
    from expertcache.hf.toy import toy_config

    cfg = toy_config(family)
    if family == "qwen3_moe":
        cfg.norm_topk_prob = True  # llama.cpp's qwen3moe graph always normalizes
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "m.gguf", "f32")
    rows = np.random.default_rng(4).integers(0, 96, size=(1, 20))
    ref, got = hf_capture(tmp_path / "hf", rows), capture_gguf(str(tmp_path / "m.gguf"), rows)
    np.testing.assert_array_equal(got.experts, ref.experts)
    np.testing.assert_allclose(got.probs, ref.probs, atol=1e-5)


def test_special_tokens_come_from_the_tokenizer_config(small_gguf):
    """EOS is the tokenizer's own (``<|endoftext|>``), not llama.cpp's gpt2 default (id 11, a word
    of this vocabulary), and no BOS is prepended, as the tokenizer config says."""
    llama_cpp = _needs_llama()
    vocab = llama_cpp.Llama(str(small_gguf), vocab_only=True, verbose=False)
    try:
        assert vocab._model.token_get_text(vocab.token_eos()) == "<|endoftext|>"
        text = vocab.tokenize(b"import os", add_bos=True)
        assert text == vocab.tokenize(b"import os", add_bos=False)
    finally:
        vocab.close()


def test_the_compiled_filter_hands_python_only_the_prefixed_names(toy):
    """With numba the eval callback's ask is answered in machine code: an observer that declares
    prefixes is asked only about names that start with one; one that declares none sees them all."""
    _needs_llama()
    from expertcache.llama.engine import Engine
    from expertcache.llama.evalfilter import compiled

    class Spy:
        def __init__(self, prefixes=None):
            if prefixes is not None:
                self.prefixes = prefixes
            self.asked, self.got = set(), 0

        def begin(self, *a):
            pass

        def wants(self, name):
            self.asked.add(name)
            return name.startswith(b"ffn_moe_topk-")

        def seen(self, name, ptr):
            self.got += 1

    with Engine(str(toy / "f32.gguf"), n_ctx=16) as eng:
        narrow = Spy((b"ffn_moe_topk-",))
        eng.attach(narrow)
        eng.forward([1, 2, 3])
        eng.detach(narrow)
        broad = Spy()
        eng.attach(broad)
        eng.forward([4])
    assert narrow.got == 3 and broad.got == 3  # the three MoE layers' top-k, either way
    assert {f"ffn_moe_topk-{i}".encode() for i in range(3)} <= narrow.asked
    if compiled() is not None:
        assert all(n.startswith(b"ffn_moe_topk-") for n in narrow.asked)
        assert any(not n.startswith(b"ffn_") for n in broad.asked)  # no prefixes: every name reaches Python
