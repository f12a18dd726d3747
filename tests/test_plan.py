"""The goodput simulator, the failure and hardware models, the planner and ``tiercheck plan``.

The simulator is checked against the exact closed form of a single blocking tier, and on
hand-computed single failures for what a failure of each domain leaves to restore from.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiercheck.cli.main import main
from tiercheck.errors import ConfigError
from tiercheck.planning.failure_model import (
    DEFAULT_FAILURE_MODEL,
    FailureClass,
    FailureModel,
    load_failure_model,
    save_failure_model,
)
from tiercheck.planning.intervals import DESIGNS, Job, plan, recommended_config
from tiercheck.planning.protocol_cost import ProtocolModel
from tiercheck.planning.simulate import (
    Failures,
    Schedule,
    TierTrack,
    daly_interval,
    draw_failures,
    expected_goodput,
    mean_ci,
    simulate,
    young_interval,
)
from tiercheck.planning.tier_costs import (
    Hardware,
    Measured,
    load_hardware,
    save_hardware,
    tier_rates,
)
from tiercheck.store.config import load_config

REPO = Path(__file__).resolve().parents[1]


def one_tier(interval: float, cost: float) -> Schedule:
    """Blocking saves of ``cost`` seconds every ``interval`` seconds of work, committed the
    moment the trainer resumes: the setting of the closed form."""
    track = TierTrack("disk", 3, "every", (0.0, 0.0), (0.0, 0.0, 0.0))
    return Schedule(interval, interval, 1, (cost, cost), (0.0, 0.0), (track,))


def test_simulator_matches_the_closed_form_within_its_confidence_interval() -> None:
    mtbf, cost, restart = 3 * 3600.0, 60.0, 300.0
    taus = [300.0, young_interval(cost, mtbf), 4 * young_interval(cost, mtbf)]
    failures = draw_failures([1 / mtbf], 54 * 86400.0, runs=48, seed=3)
    res = simulate([one_tier(t, cost) for t in taus], failures, [0, restart, 0, 0], [1])
    mean, half = mean_ci(res.goodput, level=0.99)
    exact = [expected_goodput(t, cost, restart, mtbf) for t in taus]
    for m, h, e in zip(mean, half, exact):
        assert h < 0.005  # tight enough for the comparison to mean something
        assert abs(m - e) <= h, (m, h, e)
    # the goodput falls off on both sides of Young's interval, as the closed form says
    assert mean[1] > mean[0] and mean[1] > mean[2]


def test_closed_forms() -> None:
    assert young_interval(50.0, 10_000.0) == pytest.approx(1000.0)
    # Daly's estimate is close to Young's for a cheap checkpoint, and M for a dear one
    assert daly_interval(50.0, 10_000.0) == pytest.approx(1000 * (1 + 0.05 / 3 + 0.0025 / 9) - 50)
    assert daly_interval(30_000.0, 10_000.0) == 10_000.0
    # the closed form's optimum lies next to Daly's estimate
    taus = np.linspace(200, 3000, 2801)
    best = taus[np.argmax([expected_goodput(t, 50.0, 0.0, 10_000.0) for t in taus])]
    assert abs(best - daly_interval(50.0, 10_000.0)) < 0.05 * best
    with pytest.raises(ValueError):
        expected_goodput(0.0, 1.0, 0.0, 1.0)


def test_every_second_of_the_horizon_is_accounted_for() -> None:
    shm = TierTrack("shm", 1, "every", (2.0, 2.0), (1.0, 1.0, 0.0))
    peer = TierTrack("peer", 2, "every", (5.0, 3.0), (2.0, 2.0, 0.0))
    lmdb = TierTrack("lmdb", 1, "base", (9.0, 9.0), (3.0, 3.0, 0.0))
    remote = TierTrack("remote", 3, "migrate", (400.0, 400.0), (60.0, 60.0, 0.0))
    logs = TierTrack("shm", 1, "every", (2.0, 0.5), (1.0, 1.5, 0.5))
    alone = TierTrack("r", 3, "every", (30.0, 30.0), (30.0, 30.0, 0.0))
    schedules = [
        Schedule(60.0, 60.0, 10, (0.5, 0.5), (0.1, 0.1), (shm, peer, lmdb, remote)),
        Schedule(7.0, 6.0, 4, (0.5, 0.0), (0.0, 0.0), (logs, remote)),
        Schedule(5.0, 5.0, 1, (0.1, 0.1), (0.0, 0.0), (alone,)),
    ]
    failures = draw_failures([1 / 3000, 1 / 9000, 1 / 50_000], 20 * 86400.0, runs=6, seed=1)
    res = simulate(schedules, failures, [0, 60, 300, 900], [1, 2, 3])
    total = res.progress + res.lost.sum(-1) + res.overhead + res.recovery_wall
    np.testing.assert_allclose(total, res.horizon, rtol=1e-9)
    assert (res.lost >= -1e-6).all() and (res.overhead >= 0).all()
    # the counts and the per-tier tallies agree
    assert res.served.sum(axis=(1, 2)).tolist() == [res.counts.sum()] * 3
    np.testing.assert_array_equal(res.served.sum(axis=2)[0], res.counts.sum(axis=0))


def single(time: float, domain: int, schedule: Schedule) -> tuple[float, float, int]:
    """Lost work, restore seconds and the tier slot restored from, for one failure."""
    failures = Failures(np.array([[time]]), np.array([[0]]), 2000.0, 1)
    res = simulate([schedule], failures, [0, 0, 0, 0], [domain])
    slot = int(np.argmax(res.served[0, 0]))
    return float(res.lost[0, 0, 0]), float(res.restore[0, 0, 0]), slot


def test_a_failure_destroys_every_tier_narrower_than_its_domain() -> None:
    # a save every 100 s (no blocking); shm commits 1 s later, the remote copy 31 s later
    shm = TierTrack("shm", 1, "every", (1.0, 1.0), (2.0, 2.0, 0.0))
    remote = TierTrack("remote", 3, "migrate", (30.0, 30.0), (50.0, 50.0, 0.0))
    sched = Schedule(100.0, 100.0, 1, (0.0, 0.0), (0.0, 0.0), (shm, remote))
    # 20 s after the save at 1000 s: shm holds it, the migration is still running
    assert single(1020.0, 1, sched) == pytest.approx((20.0, 2.0, 0))  # process: from shm
    assert single(1020.0, 2, sched) == pytest.approx((120.0, 50.0, 1))  # node: older remote
    # 50 s after: the remote copy has landed
    assert single(1050.0, 2, sched) == pytest.approx((50.0, 50.0, 1))
    assert single(1050.0, 3, sched) == pytest.approx((50.0, 50.0, 1))
    # with nothing surviving (an shm-only store losing a node) the job starts over
    alone = Schedule(100.0, 100.0, 1, (0.0, 0.0), (0.0, 0.0), (shm,))
    assert single(1050.0, 2, alone) == pytest.approx((1050.0, 0.0, 1))


def test_saves_wait_for_the_previous_one_and_logs_replay() -> None:
    # the synchronous write (150 s) outlasts the interval (100 s): each save waits 50 s
    slow = TierTrack("t", 3, "every", (150.0, 150.0), (0.0, 0.0, 0.0))
    sched = Schedule(100.0, 100.0, 1, (0.0, 0.0), (0.0, 0.0), (slow,))
    assert sched.period_s == 150.0
    failures = Failures(np.array([[np.inf]]), np.array([[0]]), 1500.0, 1)
    res = simulate([sched], failures, [0, 0, 0, 0], [1])
    # saves start at 100, 250, 400, ...: 100 s of work every 150 s after the first
    assert res.progress[0, 0] == pytest.approx(100 + 100 * (1400 // 150) + min(1400 % 150, 100))
    # a log version restores its base, then each log since it
    logs = TierTrack("shm", 1, "every", (1.0, 0.1), (10.0, 12.0, 2.0))
    sched = Schedule(10.0, 10.0, 4, (0.0, 0.0), (0.0, 0.0), (logs,))
    assert [logs.restore_at(j) for j in range(4)] == [10.0, 12.0, 14.0, 16.0]
    # saves at 10, 20, 30 (positions 0, 1, 2) commit by 31; the failure at 35 finds position 2
    assert single(35.0, 1, sched) == pytest.approx((5.0, 14.0, 0))


def test_schedules_refuse_nonsense() -> None:
    track = TierTrack("t", 1, "every", (1.0, 1.0), (1.0, 1.0, 0.0))
    migrated = TierTrack("r", 3, "migrate", (1.0, 1.0), (1.0, 1.0, 0.0))
    with pytest.raises(ValueError, match="synchronous"):
        Schedule(1.0, 1.0, 1, (0.0, 0.0), (0.0, 0.0), (migrated,))
    with pytest.raises(ValueError, match="k must"):
        Schedule(1.0, 1.0, 0, (0.0, 0.0), (0.0, 0.0), (track,))
    with pytest.raises(ValueError, match="finite"):
        Schedule(1.0, 1.0, 1, (-1.0, 0.0), (0.0, 0.0), (track,))
    with pytest.raises(ValueError, match="domains"):
        simulate([Schedule(1.0, 1.0, 1, (0.0, 0.0), (0.0, 0.0), (track,))],
                 draw_failures([1.0], 10.0, 2), [0, 0, 0, 0], [4])  # fmt: skip


# --- failure and hardware models ------------------------------------------------------


def test_the_default_failure_model_is_the_published_record() -> None:
    model = DEFAULT_FAILURE_MODEL
    assert sum(c.count for c in model.classes) == 419
    assert model.window_days == 54 and model.reference_gpus == 16384
    assert model.mtbf_seconds(16384) == pytest.approx(54 * 86400 / 419)
    assert model.mtbf_seconds(8192) == pytest.approx(2 * 54 * 86400 / 419)  # linear in GPUs
    by_domain = {d: sum(c.count for c in model.classes if c.domain.value == d) for d in
                 ("process", "node", "cluster")}  # fmt: skip
    assert by_domain == {"process": 61, "node": 358, "cluster": 0}


def test_failure_model_toml_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "failures.toml"
    save_failure_model(path, DEFAULT_FAILURE_MODEL)
    assert load_failure_model(path) == DEFAULT_FAILURE_MODEL
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    text = path.read_text()
    edited = text.replace('domain = "process"', 'domain = "cluster"', 1)
    assert any(
        c.domain.value == "cluster" for c in load_failure_model_text(tmp_path, edited).classes
    )
    for bad, message in [
        (text.replace('domain = "node"', 'domain = "rack"', 1), "domain must be one of"),
        (text.replace("count = 148", "count = -1"), "count must be >= 0"),
        (text + '\n[[failure]]\nname = "NIC"\ncount = 1\ndomain = "node"\n', "unique"),
        (text.replace("[restart_seconds]", "[restart_seconds]\nrack = 1.0"), "unknown domains"),
        ("window_days = 54\n", r"at least one \[\[failure\]\]"),
        ("[[failure", "cannot read"),
    ]:
        with pytest.raises(ConfigError, match=message) as info:
            load_failure_model_text(tmp_path, bad)
        assert "bad.toml" in str(info.value)
    with pytest.raises(ConfigError, match="no failure model"):
        load_failure_model(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="domain"):
        FailureClass("x", 1, "rack")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no entry"):
        FailureModel((FailureClass("x", 1, "cluster"),), restart_seconds={"node": 1.0})  # type: ignore[arg-type]


def load_failure_model_text(tmp: Path, text: str) -> FailureModel:
    path = tmp / "bad.toml"
    path.write_text(text)
    return load_failure_model(path)


def test_hardware_toml_and_measured_rates(tmp_path: Path) -> None:
    path = tmp_path / "hw.toml"
    save_hardware(path, Hardware(remote_write_gbps=100.0))
    assert load_hardware(path) == Hardware(remote_write_gbps=100.0)
    path.write_text("nic_gbps = 0\n")
    with pytest.raises(ConfigError, match="nic_gbps must be a positive"):
        load_hardware(path)
    path.write_text("nics = 1\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        load_hardware(path)
    # the committed benchmark results give rates of the same order as the built-in ones
    measured = Measured.from_benchmarks(REPO / "benchmarks" / "results")
    built_in = Measured()
    for name in ("shm_write", "shm_read", "lmdb_write", "peer_write", "remote_write"):
        assert 0.1 < getattr(measured, name) / getattr(built_in, name) < 10, name
    with pytest.raises(ConfigError, match="no benchmark results"):
        Measured.from_benchmarks(tmp_path)
    # a rank gets the smaller of tiercheck's own rate and its share of the medium
    rates = tier_rates(Hardware(), built_in, gpus=16384, gpus_per_node=8)
    assert rates["remote"].write_medium_gbps == pytest.approx(2000 / 16384)
    assert rates["remote"].limits()[0] == "remote store"
    assert rates["shm"].write_seconds(4e9, 4e8) == pytest.approx(4 / 2.193)
    assert rates["remote"].write_seconds(4e9, 4e8) == pytest.approx(
        max(4 / 0.499, 0.4 / (2000 / 16384))
    )


# --- the planner ------------------------------------------------------------------------

SMALL = {"runs": 4, "intervals": 8}


def test_plan_finds_what_the_tiers_buy_when_the_remote_store_is_slow() -> None:
    job = Job(gpus=4096, state_bytes_per_rank=4e9, mean_state_bytes_per_rank=4e9, days=20)
    slow = Hardware(remote_write_gbps=100.0, remote_read_gbps=100.0)
    result = plan(job, hardware=slow, designs=DESIGNS[:1] + DESIGNS[4:5], **SMALL)
    remote, tiered = result.design("remote"), result.design("tiered")
    assert remote.gain == 0.0
    # the tiered store restores node losses from peer memory: a clear, paired gain
    assert tiered.gain is not None and tiered.gain_ci is not None
    assert tiered.gain > tiered.gain_ci > 0
    assert result.best is tiered
    assert {c.restored_from for c in tiered.classes} == {"shm", "peer"}
    assert {c.restored_from for c in remote.classes} == {"remote"}
    assert tiered.interval_s < remote.interval_s  # cheap saves: save more often
    assert tiered.keeps_up
    peer = next(t for t in tiered.tiers if t.tier == "peer")
    assert peer.young_s is not None and peer.serves
    # fractions and goodput add up to the whole
    for d in result.designs:
        assert d.goodput + d.overhead + d.lost + d.recovery == pytest.approx(1.0, abs=1e-9)
        assert d.curve and all(0 < g <= 1 for _, g, _ in d.curve)
    json.dumps(result.to_json(), allow_nan=True)


def test_log_versions_pay_only_where_failures_outrun_staging() -> None:
    # a log costs its capture at every step; a full save costs its staging once per version.
    # At the reference failure rate the planner keeps full versions...
    default = plan(Job(gpus=2048, days=5), designs=DESIGNS[4:6], **SMALL)
    assert not default.design("tiered+log").uses_logs
    # ...but with staging at 1 GB/s, a failure every ten minutes and logs of 1% of the
    # state per step, logging every few steps beats saving the whole state as often
    job = Job(gpus=64, gpus_per_node=8, state_bytes_per_rank=8e9, mean_state_bytes_per_rank=8e9,
              step_seconds=10.0, days=2)  # fmt: skip
    often = FailureModel((FailureClass("crash", 144.0, "process"),), window_days=1.0,
                         reference_gpus=64, restart_seconds={"process": 60.0})  # fmt: skip
    hw = Hardware(pcie_gbps=1.0)
    result = plan(job, often, hw, designs=DESIGNS[4:6], log_bytes_per_step=0.01, **SMALL)
    plain, logged = result.design("tiered"), result.design("tiered+log")
    assert logged.uses_logs and not plain.uses_logs
    assert logged.steps_per_version < plain.steps_per_version
    assert logged.goodput > plain.goodput + plain.goodput_ci
    with pytest.raises(ConfigError, match="log_bytes_per_step"):
        plan(job, designs=DESIGNS[:1], log_bytes_per_step=0.0, **SMALL)


def test_recommended_config_is_a_valid_store_configuration(tmp_path: Path) -> None:
    job = Job(gpus=512, days=5)
    result = plan(job, designs=DESIGNS[:1] + DESIGNS[4:5], **SMALL)
    for name in ("remote", "tiered"):
        path = tmp_path / f"{name}.toml"
        path.write_text(recommended_config(result, name))
        config = load_config(path)
        d = result.design(name)
        assert [t.name for t in config.tiers] == list(d.design.tiers)
        assert config.policy.base_every == d.base_every
        assert f"every {d.steps_per_version} steps" in path.read_text()
    assert load_config(path).policy.tiers["remote"].mode == "async"


def test_job_and_design_validation() -> None:
    with pytest.raises(ConfigError, match="mean_state_bytes_per_rank"):
        Job(state_bytes_per_rank=1e9, mean_state_bytes_per_rank=2e9)
    with pytest.raises(ConfigError, match="gpus_per_node"):
        Job(gpus=4, gpus_per_node=8)
    with pytest.raises(ConfigError, match="unique"):
        plan(Job(gpus=64, days=1), designs=DESIGNS[:1] * 2, **SMALL)


# --- the command line -------------------------------------------------------------------

_PROBE = """
import json, sys
from tiercheck.cli.main import main
rc = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump(sorted(sys.modules), f)
sys.exit(rc)
"""


def test_plan_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a fresh interpreter: the command runs without torch
    modules = tmp_path / "modules.json"
    out = tmp_path / "tiercheck.toml"
    args = ["plan", "--gpus", "1024", "--days", "5", "--runs", "3", "--config-out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(modules), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert "tiercheck.planning.simulate" in json.loads(modules.read_text())
    assert "torch" not in json.loads(modules.read_text())
    assert [d["design"]["name"] for d in data["designs"]] == [d.name for d in DESIGNS]
    assert data["best"] in {d.name for d in DESIGNS}
    assert load_config(out).policy.base_every >= 1
    assert data["recommended_toml"] == out.read_text()

    # the default model, edited: a cluster-wide failure class restores from the remote tier
    model = tmp_path / "failures.toml"
    assert main(["plan", "--write-failures", str(model)]) == 0
    text = (
        model.read_text() + '\n[[failure]]\nname = "site power"\ncount = 20\ndomain = "cluster"\n'
    )
    model.write_text(text)
    capsys.readouterr()
    rc = main(["plan", "--gpus", "2048", "--days", "20", "--runs", "3", "--failures", str(model),
               "--design", "tiered", "--remote-gbps", "500", "--json"])  # fmt: skip
    assert rc == 0
    tiered = json.loads(capsys.readouterr().out)["designs"][0]
    power = next(c for c in tiered["classes"] if c["name"] == "site power")
    assert power["restored_from"] == "remote" and power["domain"] == "cluster"

    # the human tables
    assert main(["plan", "--gpus", "512", "--days", "2", "--runs", "2", "--design", "remote"]) == 0
    text = capsys.readouterr().out
    for word in ("designs at their best interval", "per failure class", "faulty GPU", "Young"):
        assert word in text

    # usage errors: exit status 2, the error on the last line of stderr
    for bad in (["--design", "nope"], ["--failures", str(tmp_path / "none.toml")],
                ["--gpus", "0"], ["--state-per-rank", "lots"],
                ["--state-per-rank", "1GB", "--mean-state-per-rank", "2GB"]):  # fmt: skip
        assert main(["plan", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert "error:" in err.strip().splitlines()[-1], (bad, err)


def test_plan_counts_the_commit_protocol_at_the_jobs_rank_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/protocol.py's model: the cost per save follows log2 of the ranks (bytes:
    a rank's chunks plus 36 per rank); one rank has no protocol; a sync tier's save time
    includes it; ``--bench DIR`` reads the model from DIR/protocol.json."""
    model = ProtocolModel()
    chunks = model.chunks(4e9)
    assert chunks == math.ceil(4e9 / (4 << 20))
    assert model.seconds(1, chunks) == 0.0 and model.bytes(1, chunks) == 0.0
    at = {n: model.seconds(n, chunks) for n in (2, 16, 16384)}
    assert at[2] < at[16] < at[16384] < 0.100  # issue 24's goal, by the model
    assert model.bytes(16384, chunks) - model.bytes(2, chunks) == 36.0 * 16382
    slow = ProtocolModel(alpha_s=0.5)  # half a second per hop: it must show in the save
    job = Job(gpus=1024, days=2)
    fast_plan = plan(job, designs=DESIGNS[2:3], **SMALL)
    slow_plan = plan(job, designs=DESIGNS[2:3], protocol=slow, **SMALL)
    assert slow_plan.protocol_s == pytest.approx(slow.seconds(1024, chunks))
    fast = {t.tier: t.save_s for t in fast_plan.designs[0].tiers}
    slower = {t.tier: t.save_s for t in slow_plan.designs[0].tiers}
    assert slower["shm"] - fast["shm"] == pytest.approx(slow_plan.protocol_s - fast_plan.protocol_s)
    assert slower["remote"] == fast["remote"]  # migrated: no protocol in the way
    assert fast_plan.to_json()["protocol"]["seconds_per_save"] == fast_plan.protocol_s

    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "protocol.json").write_text(json.dumps({"chunks": 300, "layouts": {}}))
    with pytest.raises(ConfigError, match="lack"):
        ProtocolModel.from_benchmarks(bench)
    fitted = {
        "calls": 9,
        "alpha_s": 1e-3,
        "beta_bytes_per_s": 1e9,
        "t_cpu_s": 3e-3,
        "bytes_intercept": 12600.0,
        "bytes_per_chunk": 41,
        "bytes_per_rank": 36.0,
    }
    (bench / "protocol.json").write_text(
        json.dumps({"chunks": 300, "layouts": {"sharded": {"model": fitted}}})
    )
    loaded = ProtocolModel.from_benchmarks(bench)
    assert (loaded.alpha_s, loaded.cpu_s_per_chunk, loaded.fixed_bytes) == (1e-3, 1e-5, 300.0)
    assert main(["plan", "--gpus", "64", "--days", "1", "--runs", "2", "--design", "remote",
                 "--bench", str(bench), "--json"]) == 2  # fmt: skip
    assert "latest.json" in capsys.readouterr().err  # the tier rates are still needed there
