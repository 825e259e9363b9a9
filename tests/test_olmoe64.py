"""models/olmoe-64x8: the committed checkpoint is what its README says: a real OlmoeForCausalLM at
OLMoE's routing geometry, small enough to travel, and its held-out NLL reproduces (code domain)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import REPO

MODEL = REPO / "models" / "olmoe-64x8"


def test_geometry_and_size():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["OlmoeForCausalLM"]
    assert (cfg["num_experts"], cfg["num_experts_per_tok"]) == (64, 8) and cfg["num_hidden_layers"] >= 8
    assert (MODEL / "model.safetensors").stat().st_size <= 32 * 2**20


def test_held_out_nll_reproduces_the_readme(one_thread):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    readme = (MODEL / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| this model (saved float16"))
    claimed = float(row.split("|")[5])  # the code column
    rows = [r["row"] for r in json.loads((MODEL / "heldout_rows.json").read_text()) if r["domain"] == "code"]
    ids = torch.from_numpy(np.load(MODEL / "heldout_ids.npy")[rows])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        nll = []
        for i in range(0, len(ids), 16):
            x = ids[i : i + 16]
            logits = model(input_ids=x, use_cache=False).logits.float()
            nll.append(torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none"))
    assert float(torch.cat(nll).mean()) == pytest.approx(claimed, abs=2e-3)
    best = re.search(r"beats the best n-gram \(\w+, ([0-9.]+)\)", readme)
    assert best and float(best.group(1)) > float(row.split("|")[2])  # the all-rows column
