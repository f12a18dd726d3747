"""The ``tiercheck`` command line, driven as a subprocess (``python -m tiercheck``) on real
stores (an ``lmdb://`` tier and a ``file://`` remote tier under ``tmp_path``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _fresh
import pytest
import torch
from _blobs import newer_major

from tiercheck import Checkpointer, Policy, TierPolicy, open_tier
from tiercheck.formats.codecs import Codec, encode_blob
from tiercheck.formats.ids import chunk_id

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Store:
    root: Path
    states: dict[int, dict[str, Any]]  # version id -> flat state saved
    lmdb_url: str
    remote_url: str


def _flat_state(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    w[0, 0] += i  # one element changes per version
    return {
        "model/w": w,
        "model/frozen": torch.randn(32, 32, generator=g),
        "model/emb": torch.arange(48, dtype=torch.bfloat16).reshape(6, 8),
        "optim/step": torch.tensor(i, dtype=torch.int64),
        "step": i,
        "extra": {"note": "abc"},
    }


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def make_store(tmp: Path, n: int = 5) -> Store:
    """Versions 0..n-1 at steps 0, 10, ...: bases every 3rd, diffs between."""
    root = tmp / "store"
    lmdb_url = f"lmdb://{tmp / 'lmdb'}"
    remote_url = f"file://{tmp / 'remote'}"
    policy = Policy(
        chunk_size=4096,
        base_every=3,
        tiers={
            "lmdb": TierPolicy(versions="all", keep_bases=None),
            "remote": TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=None),
        },
    )
    states: dict[int, dict[str, Any]] = {}
    with Checkpointer(root, tiers=[("lmdb", lmdb_url), ("remote", remote_url)], policy=policy) as c:
        for i in range(n):
            flat = _flat_state(i)
            res = c.save(i * 10, _nest(flat), metadata={"loss": 1.0 / (i + 1)}).wait()
            assert res.version is not None
            states[res.version] = flat
        c.wait_migrations()
    return Store(root, states, lmdb_url, remote_url)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return make_store(tmp_path)


def tc(*args: str | Path, ok: tuple[int, ...] | None = (0,)) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tiercheck ARGS``; check the exit status is in ``ok`` (None: any)."""
    env = {**os.environ, "COLUMNS": "200"}
    proc = _fresh.run(
        ["-m", "tiercheck", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if ok is not None and proc.returncode not in ok:
        raise AssertionError(
            f"tiercheck {args} exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
            f"stderr:\n{proc.stderr}"
        )
    return proc


def tc_json(*args: str | Path, ok: tuple[int, ...] = (0,)) -> Any:
    return json.loads(tc(*args, "--json", ok=ok).stdout)


def inproc(
    capsys: pytest.CaptureFixture[str], *args: str | Path, ok: int = 0, as_json: bool = False
) -> Any:
    """Run the CLI's ``main`` in this process (cheaper than a subprocess: no torch import);
    used for the second and later calls of a test, each command also runs as a subprocess."""
    from tiercheck.cli.main import main

    capsys.readouterr()
    rc = main([*map(str, args), *(["--json"] if as_json else [])])
    out = capsys.readouterr()
    assert rc == ok, (args, rc, out.out, out.err)
    return json.loads(out.out) if as_json else out.out


def test_ls_json_and_table(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    data = tc_json("ls", store.root)
    assert [t["name"] for t in data["tiers"]] == ["lmdb", "remote"]
    versions = data["versions"]
    assert [v["step"] for v in versions] == [0, 10, 20, 30, 40]
    assert [v["role"] for v in versions] == ["base", "diff", "diff", "base", "diff"]
    assert versions[1]["base"] == versions[0]["id"]
    assert versions[0]["tiers"] == {"lmdb": "committed", "remote": "committed"}
    assert versions[1]["tiers"] == {"lmdb": "committed", "remote": "missing"}
    assert all(v["restorable"] for v in versions)
    assert versions[0]["metadata"] == {"loss": 1.0}
    assert versions[0]["logical_bytes"] > 0 and versions[0]["stored_bytes"] > 0
    assert set(versions[0]) >= {"id", "time", "time_iso", "world_size"}
    table = tc("ls", store.root).stdout
    assert "committed" in table and "missing" in table
    assert "ago" in table or "just now" in table  # relative times next to absolute ones
    limited = inproc(capsys, "ls", store.root, "--limit", "2", as_json=True)
    assert limited["versions"] == versions[-2:]


def test_ls_next_to_a_running_writer(store: Store) -> None:
    with Checkpointer(store.root) as writer:  # holds the writer lock
        writer.save(99, _nest(_flat_state(9))).wait()
        data = tc_json("ls", store.root)
    assert data["versions"][-1]["step"] == 99


def test_show(store: Store) -> None:
    data = tc_json("show", store.root, "step:10")
    assert data["step"] == 10 and data["role"] == "diff"
    entries = {e["key"]: e for e in data["entries"]}
    assert entries["model/w"] == {
        "key": "model/w",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [64, 64],
        "size": 64 * 64 * 4,
        "chunks": 4,
        "replayed": None,  # the name of a log version's leaf that its replay reproduces
    }
    assert entries["step"]["kind"] == "msgpack"
    assert data["chunks"]["total"] >= 6 and data["chunks"]["dedup_ratio"] >= 1.0
    bd = data["base_delta"]
    assert bd["id"] == data["base"] and 0 < bd["chunks_changed"] < data["chunks"]["total"]
    assert data["tier_detail"]["lmdb"]["state"] == "committed"
    assert data["tier_detail"]["lmdb"]["bytes_written"] > 0
    text = tc("show", store.root, "latest").stdout
    assert "model/emb" in text and "bfloat16" in text and "dedup ratio" in text


def test_diff(store: Store) -> None:
    ids = sorted(store.states)
    d = tc_json("diff", store.root, ids[0], ids[2])
    changed = {c["key"]: c for c in d["changed"]}
    assert set(changed) == {"model/w", "optim/step", "step"}
    assert changed["model/w"]["max_abs_diff"] == pytest.approx(2.0)
    assert changed["model/w"]["rel_l2"] > 0
    assert {"model/frozen", "model/emb", "extra"} <= set(d["unchanged"])
    assert d["unchanged_by_id"] >= 1 and not d["added"] and not d["removed"]
    text = tc("diff", store.root, ids[0], "latest").stdout
    assert "model/w" in text and "changed" in text


def _corrupt(url: str, blob_id: str) -> None:
    tier = open_tier(url)
    try:
        tier.put(blob_id, encode_blob(b"these are not the bytes", Codec.RAW), overwrite=True)
    finally:
        tier.close()


def test_verify_finds_and_repairs_a_corrupt_blob(
    store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tc_json("verify", store.root)["ok"] is True
    first = min(store.states)
    with Checkpointer(store.root, read_only=True) as r:
        victim = r.version(first).entries["model/frozen"].chunks[0]
    _corrupt(store.lmdb_url, victim)
    report = tc_json("verify", store.root, ok=(1,))
    assert report["ok"] is False
    (problem,) = report["problems"]
    assert (problem["tier"], problem["id"], problem["kind"]) == ("lmdb", victim, "corrupt")
    assert first in problem["versions"] and problem["repaired"] is False
    only_remote = inproc(capsys, "verify", store.root, "--tier", "remote", as_json=True)
    assert only_remote["ok"] is True and [t["tier"] for t in only_remote["tiers"]] == ["remote"]
    human = inproc(capsys, "verify", store.root, ok=1)
    assert "corrupt" in human and victim in human
    fixed = tc_json("verify", store.root, "--repair")
    assert fixed["ok"] is True and fixed["repaired"] == 1
    assert tc_json("verify", store.root)["problems"] == []


def test_verify_reports_a_newer_format_blob_and_goes_on(
    store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    first = min(store.states)  # a base: the remote tier holds a copy to repair from
    with Checkpointer(store.root, read_only=True) as r:
        newer = r.version(first).entries["model/frozen"].chunks[0]
        victim = r.version(first).entries["model/w"].chunks[0]
    tier = open_tier(store.lmdb_url)
    try:
        tier.put(newer, newer_major(bytes(tier.get(newer))), overwrite=True)
    finally:
        tier.close()
    _corrupt(store.lmdb_url, victim)
    report = tc_json("verify", store.root, ok=(1,))
    kinds = {(p["tier"], p["id"]): p["kind"] for p in report["problems"]}
    assert kinds == {("lmdb", newer): "newer-format", ("lmdb", victim): "corrupt"}
    assert [t["tier"] for t in report["tiers"]] == ["lmdb", "remote"]
    assert all(t["blobs"] > 1 for t in report["tiers"])
    human = inproc(capsys, "verify", store.root, ok=1)
    assert f"{newer}: newer-format" in human and "upgrade tiercheck" in human
    # --repair fixes the corrupt copy and leaves the newer one alone: still exit status 1
    fixed = inproc(capsys, "verify", store.root, "--repair", ok=1, as_json=True)
    left = [p for p in fixed["problems"] if not p["repaired"]]
    assert [(p["id"], p["kind"]) for p in left] == [(newer, "newer-format")]


def test_export_safetensors_and_pt(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    latest = max(store.states)
    want = store.states[latest]
    st = tmp_path / "model.safetensors"
    res = tc_json("export", store.root, "latest", st, "--only", "model/")
    assert res["format"] == "safetensors" and res["entries"] == 3
    tensors = load_file(str(st))
    assert set(tensors) == {"w", "frozen", "emb"}
    for k, t in tensors.items():
        assert t.dtype == want[f"model/{k}"].dtype and torch.equal(t, want[f"model/{k}"])

    pt = tmp_path / "all.pt"
    res = tc_json("export", store.root, str(latest), pt)
    assert res["format"] == "torch" and res["skipped"] == []
    loaded = torch.load(pt, weights_only=True)
    assert set(loaded) == set(want)
    for k, value in want.items():
        if isinstance(value, torch.Tensor):
            assert loaded[k].dtype == value.dtype and torch.equal(loaded[k], value), k
        else:
            assert loaded[k] == value

    st_all = tmp_path / "all.safetensors"
    res = inproc(capsys, "export", store.root, "latest", st_all, as_json=True)
    assert sorted(res["skipped"]) == ["extra", "step"]
    assert set(load_file(str(st_all))) == {"model/w", "model/frozen", "model/emb", "optim/step"}
    # refuses to overwrite without --force
    inproc(capsys, "export", store.root, "latest", pt, ok=2)
    inproc(capsys, "export", store.root, "step:0", pt, "--force")
    assert torch.load(pt, weights_only=True)["step"] == 0


def test_gc(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    orphan_raw = b"an orphan blob no version references"
    orphan = chunk_id(orphan_raw)
    tier = open_tier(store.lmdb_url)
    tier.put(orphan, encode_blob(orphan_raw, Codec.RAW))
    tier.close()
    dry = tc_json("gc", store.root, "--dry-run")
    rows = {r["tier"]: r for r in dry["tiers"]}
    assert dry["dry_run"] is True and rows["lmdb"]["unreferenced"] == 1
    assert rows["lmdb"]["deleted"] == 0
    kept = inproc(
        capsys, "gc", store.root, as_json=True
    )  # default grace: the clock starts now, nothing goes
    assert {r["tier"]: r["deleted"] for r in kept["tiers"]} == {"lmdb": 0, "remote": 0}
    done = tc_json("gc", store.root, "--grace", "0")
    rows = {r["tier"]: r for r in done["tiers"]}
    assert rows["lmdb"]["deleted"] == 1 and rows["remote"]["deleted"] == 0
    tier = open_tier(store.lmdb_url, read_only=True)
    assert not tier.has([orphan])
    tier.close()
    assert inproc(capsys, "verify", store.root, as_json=True)["ok"] is True
    assert "gc" in inproc(capsys, "gc", store.root, "--dry-run")


def test_migrate(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = inproc(capsys, "ls", store.root, as_json=True)["versions"]
    diff_row = next(v for v in rows if v["role"] == "diff")
    # to one of the store's own tiers (remote keeps only bases by policy; migrate copies anyway)
    res = tc_json("migrate", store.root, diff_row["id"], "--to", "remote")
    assert res["versions"] == [diff_row["id"]] and res["already"] == [diff_row["base"]]
    rows = inproc(capsys, "ls", store.root, as_json=True)["versions"]
    row = next(v for v in rows if v["id"] == diff_row["id"])
    assert row["tiers"]["remote"] == "committed"
    # to a URL outside the store: a self-contained copy (base first)
    other = tmp_path / "other"
    res = tc_json("migrate", store.root, f"step:{diff_row['step']}", "--to", f"file://{other}")
    assert res["versions"] == [diff_row["base"], diff_row["id"]] and not res["configured"]
    with Checkpointer(tmp_path / "other-store", tiers=[f"file://{other}"]) as c:
        got = c.version(diff_row["id"]).to_state_dict()
    want = store.states[diff_row["id"]]
    assert torch.equal(got["model/w"], want["model/w"]) and got["step"] == want["step"]
    assert "copied" in inproc(capsys, "migrate", store.root, "latest", "--to", f"file://{other}2")


BAD_INPUTS = [
    ["ls", "{missing}"],
    ["ls", "{notstore}"],
    ["show", "{root}", "999"],
    ["show", "{root}", "step:abc"],
    ["diff", "{root}", "0", "step:12345"],
    ["export", "{root}", "nope", "{tmp}/x.pt"],
    ["export", "{root}", "latest", "{tmp}/no/such/dir/x.pt"],
    ["export", "{root}", "latest", "{tmp}/x.txt"],
    ["export", "{root}", "latest", "{tmp}"],
    ["export", "{root}", "latest", "{tmp}/x.pt", "--only", "nothing/"],
    ["verify", "{root}", "--tier", "nosuchtier"],
    ["verify", "{missing}", "--repair"],
    ["gc", "{missing}"],
    ["migrate", "{root}", "latest", "--to", "nosuchscheme://x"],
    ["migrate", "{root}", "latest", "--to", "not a url"],
]
# one of each kind (root, version, output path, tier URL) also as a real subprocess
BAD_IN_SUBPROCESS = (0, 2, 6, 13)


def _bad_args(store: Store, tmp_path: Path, args: list[str]) -> list[str]:
    (tmp_path / "plain").mkdir(exist_ok=True)
    subs = {
        "root": str(store.root),
        "missing": str(tmp_path / "missing"),
        "notstore": str(tmp_path / "plain"),
        "tmp": str(tmp_path),
    }
    return [a.format(**subs) for a in args]


def test_bad_inputs_give_one_line_and_exit_2(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiercheck.cli.main import main

    for args in BAD_INPUTS:
        assert main(_bad_args(store, tmp_path, args)) == 2, args
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tiercheck: error: "), (args, err)
    for i in BAD_IN_SUBPROCESS:
        proc = tc(*_bad_args(store, tmp_path, BAD_INPUTS[i]), ok=(2,))
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tiercheck: error: "), proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "missing").exists()  # nothing was created


def test_usage_errors_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    inproc(capsys, "ls", ok=2)
    inproc(capsys, "frobnicate", ok=2)
    assert "verify" in tc("--help").stdout


def test_peer_serve_and_status(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tiercheck",
            "peer",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--memory-limit",
            "16MiB",
            "--insecure-no-auth",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once clients can connect
        address = json.loads(line)["listening"]
        stats = tc_json("peer", "status", address)
        assert isinstance(stats, dict) and stats
        assert "peer" in tc("peer", "status", address).stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    down = tc("peer", "status", address, "--timeout", "5", ok=(1,))
    assert len(down.stderr.strip().splitlines()) == 1


# Runs the CLI's main in a fresh interpreter, then writes the names of every module imported.
_PROBE = """
import json, sys
from tiercheck.cli.main import main
rc = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump(sorted(sys.modules), f)
sys.exit(rc)
"""


def imported_by(tmp_path: Path, *args: str | Path, ok: tuple[int, ...] = (0,)) -> set[str]:
    """The modules a fresh ``tiercheck ARGS`` imports."""
    out = tmp_path / "modules.json"
    out.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(out), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in ok, (args, proc.returncode, proc.stderr)
    return set(json.loads(out.read_text()))


def test_peer_commands_and_help_do_not_import_torch(tmp_path: Path) -> None:
    # a daemon on a memory node, and a query of it, have no use for torch
    status = imported_by(tmp_path, "peer", "status", "127.0.0.1:1", "--timeout", "5", ok=(0, 1))
    assert "tiercheck.backends._peer" in status  # the command ran
    assert "torch" not in status and "numpy" not in status
    assert "torch" not in imported_by(tmp_path, "--help")


def test_browsing_does_not_import_torch(store: Store, tmp_path: Path) -> None:
    commands = [
        ("ls", store.root),
        ("show", store.root, "latest"),
        ("gc", store.root, "--dry-run"),
        ("verify", store.root),
    ]
    found = {}
    for args in commands:
        modules = imported_by(tmp_path, *args, "--json")
        assert "tiercheck.checkpointer" in modules  # the command opened the store
        found[args[0]] = "torch" in modules
    assert found == {"ls": False, "show": False, "gc": False, "verify": False}


def test_cli_reference_matches_the_parser() -> None:
    sys.path.insert(0, str(REPO / "docs"))
    try:
        import gen_cli
    finally:
        sys.path.pop(0)
    current = (REPO / "docs" / "cli.md").read_text()
    assert current == gen_cli.render(), "docs/cli.md is stale: run python docs/gen_cli.py"
