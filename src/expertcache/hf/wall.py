"""``eval --memory-wall C``: the live harness as a child process behind the tier's memory wall.

The wall is :func:`expertcache.wall.capacity.run_walled` (a memory cgroup, limit = C + headroom,
swap excluded): everything the child touches, its anonymous memory and the page cache it brings
in, is charged there, so with ``--host mmap`` the page cache holding experts is at most C (the
host tier's capacity) and a miss beyond it pays the device.

The tier is the checkpoint's page cache (its shards' cached bytes, measured by ``cachestat``), evicted
before the run so that every page of it is the child's; the limit follows the child's own memory
(anonymous, kernel, and the page cache of everything else it reads: torch's libraries, imported cold,
are not the tier), so no calibration run measures it first. The run's proof (``proof_ok``) says
whether the tier stayed within C (the capacity module's checks).

A checkpoint saved in the legacy per-expert layout is converted on load (every expert copied into
the packed tensors), a transient of about twice the experts' bytes in the child's own memory; a
checkpoint in the model's own packed layout (:func:`save_packed`) loads zero-copy (the experts are
views of the file).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import ConfigError

PROOF_KEYS = ("mechanism", "limit_bytes", "capacity_bytes", "headroom_bytes", "peak_bytes", "anon_peak_bytes",
              "tier_peak_bytes", "file_peak_bytes", "own_peak_bytes", "tier_measure", "min_limit_bytes",
              "max_limit_bytes", "limit_writes", "oom_waits", "oom_kill", "samples")


def walled_eval(child_argv: list[str], capacity_bytes: int, *, tier_files, headroom_bytes: int | None = None,
                wall: str = "auto", timeout: float | None = None):
    """Run ``expertcache eval`` (``child_argv``, which must print ``--json``) behind a wall of
    ``capacity_bytes`` whose limit follows the child's own memory
    (:func:`~expertcache.wall.capacity.follow_plan`); the tier is the page cache of ``tier_files``
    (the checkpoint's shards). Returns ``(records, wall_record, stderr)``; the records are the
    child's, each with ``memory_wall`` added."""
    from ..wall import capacity as cap
    from ..wall.pagecache import evict_for_wall

    headroom, margin, note = cap.follow_plan(capacity_bytes, headroom_bytes)
    evict_for_wall(list(tier_files), "--model")  # cold: the tier's pages are the child's, charged to its wall
    run = cap.run_walled(_python(child_argv), capacity_bytes=capacity_bytes, wall=wall, headroom_bytes=headroom,
                         timeout=timeout, follow_margin=margin, tier_files=list(tier_files), tier_locked=False)
    records = _records(run, "the walled run")
    proof = run.proof if isinstance(run.proof, dict) else {}
    record = {"capacity_bytes": capacity_bytes, "headroom_bytes": headroom, "headroom_note": note,
              "enforced_by": run.enforced_by, "proof_ok": bool(run.proof_ok) and bool(proof), "note": run.note,
              "proof": {k: proof.get(k) for k in PROOF_KEYS if k in proof}}
    for r in records:
        r["memory_wall"] = record
    return records, record, run.stderr or ""


def _python(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "expertcache.cli.main", *argv]


def _records(run, what: str) -> list[dict]:
    """The child's JSON records, or a one-line error saying why there are none."""
    if run.returncode not in (0, 1):  # 1: the child's checks failed, its records still came
        lines = [ln for ln in (run.stderr or "").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {run.returncode}"
        if run.returncode is not None and run.returncode < 0:
            why = f"killed by signal {-run.returncode} inside the {run.enforced_by} wall ({run.note or 'no note'})"
        raise ConfigError(f"--memory-wall: {what} failed: {why}")
    try:
        records = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    except ValueError:
        records = []
    if not records:
        lines = [ln for ln in (run.stderr or "").splitlines() if ln.strip()]
        raise ConfigError(f"--memory-wall: {what} printed no JSON records ({lines[-1] if lines else 'no message'})")
    return records


def save_packed(src: "str | Path", out: "str | Path") -> Path:
    """Write the checkpoint at ``src`` to ``out`` in the model's own layout (the packed
    ``gate_up_proj`` / ``down_proj`` of the loaded model, every tensor under the name the model
    gives it), so that transformers loads it without converting: the experts stay views of the
    file (no transient copy) and ``host="mmap"`` / ``"direct"`` read them from there. ``out`` must
    not exist (nothing is overwritten)."""
    import shutil

    from safetensors.torch import save_file

    from .loading import check_checkpoint, load_model

    src, out = check_checkpoint(src), Path(out)
    if out.exists():
        raise ConfigError(f"{out}: already exists (nothing is overwritten)")
    model = load_model(src, device="cpu")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, tmp / name)
    tensors, seen = {}, {}
    for name, t in model.state_dict().items():
        key = t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)
        if key in seen:  # tied weights are saved once, as transformers does
            continue
        seen[key] = name
        tensors[name] = t.contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return out
