"""Mutation testing (mutmut 3) of the orchestration tier, one module at a time against its own tests.

    python tools/mutate.py                          # every module of MODULES (hours on 2 cores)
    python tools/mutate.py megatron_rl/collectives.py megatron_rl/data/loader.py
    python tools/mutate.py --sample 60 megatron_rl/loop/phases.py   # 60 of its mutants, drawn (seeded)
    python tools/mutate.py --list                   # the module -> tests map
    make mutate                                     # the same as the first line (not run in CI)

Each module gets its own scratch copy of the project under .mutate/<module>/ with a setup.cfg whose
[mutmut] section mutates that module only and runs only its tests, so mutmut's stats collection
and each mutant's test run stay short, and a second run resumes (mutmut keeps its results in
.mutate/<module>/mutants/). The summary (killed / survived / timeout / other per module, the
surviving mutants by name) is printed and written to .mutate/summary.json; `mutmut show NAME` in
.mutate/<module>/ prints a survivor's diff. docs/testing.md records how each survivor was triaged.

Subprocess tests (torchrun, spawned ranks) import the mutated copy too (PYTHONPATH points at it and
mutmut's MUTANT_UNDER_TEST is inherited), but mutmut maps tests to functions from calls seen in its
own process only, so a module's map should name in-process tests first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutate"
COPY = ("megatron_rl", "tests", "examples", "pytest.ini", "setup.py", "Makefile")  # tests read the pins in both
# The console script, not `python -m mutmut`: -m puts the scratch folder (unmutated sources) first
# on sys.path, ahead of PYTHONPATH's mutated copy.
MUTMUT = str(Path(sys.executable).with_name("mutmut"))

# module -> the tests a developer runs for it (fast, in-process first; pytest arguments). On 2 cores mutmut's
# own run of phases takes about 65 minutes and of build about 50, then the spawned stage (docs/testing.md
# has the measured times).
MODULES: dict[str, list[str]] = {
    # Megatron's async writer (a process forked from the mutant's forked worker) does not finish
    # under mutmut's runner: the async test runs in the ordinary suite (docs/testing.md).
    "megatron_rl/loop/checkpoint.py": ["tests/unit/test_checkpoint_faults.py", "--deselect",
                                       "tests/unit/test_checkpoint_faults.py::"
                                       "test_an_async_save_is_published_only_when_its_write_has_finished"],
    "megatron_rl/loop/batch.py": ["tests/unit/test_rl_batch.py"],
    "megatron_rl/loop/refill.py": ["tests/unit/test_refill_plan.py"],
    "megatron_rl/loop/colocated.py": ["tests/unit/test_colocated_memory.py", "tests/e2e/test_colocated.py"],
    # A tiny real run per test (test_phases_run.py); the end-to-end traces across steps
    # (tests/e2e/test_rl_orchestration.py) run in the ordinary suite.
    "megatron_rl/loop/phases.py": ["tests/unit/test_phases_run.py", "tests/unit/test_phases_batch_shapes.py",
                                   "tests/unit/test_phases_calib.py", "tests/unit/test_phases_losses.py"],
    # Built runs and launched server doubles, checked on the objects (test_build_run.py); the
    # end-to-end runs (tests/e2e/test_rl_loop.py, test_colocated.py) are in the ordinary suite.
    "megatron_rl/loop/build.py": ["tests/unit/test_build_run.py", "tests/unit/test_build_model_dir.py",
                                  "tests/unit/test_placement.py::test_each_rank_gets_the_sglang_settings_of_its_role"],
    "megatron_rl/cluster/placement.py": ["tests/unit/test_placement.py"],
    "megatron_rl/cluster/launch.py": ["tests/unit/test_launch_entry.py", "tests/unit/test_launch.py"],
    "megatron_rl/cluster/plan.py": ["tests/unit/test_plan_report.py", "tests/unit/test_plan.py"],
    "megatron_rl/cluster/memory.py": ["tests/unit/test_memory_parts.py", "tests/unit/test_plan_report.py",
                                      "tests/unit/test_plan.py"],
    "megatron_rl/sync/weight_sync.py": ["tests/unit/test_sync_check.py", "tests/unit/test_sync_buckets.py"],
    "megatron_rl/sync/buckets.py": ["tests/unit/test_sync_buckets.py"],
    "megatron_rl/sync/disk_transport.py": ["tests/unit/test_transport_disk.py"],
    "megatron_rl/sync/sglang_transport.py": ["tests/unit/test_transport_sglang.py"],
    "megatron_rl/rollout/sglang_client.py": ["tests/unit/test_sglang_client.py", "tests/unit/test_sglang_engine.py",
                                             "tests/unit/test_retry_boundaries.py"],
    "megatron_rl/rollout/sglang_engine.py": ["tests/unit/test_sglang_engine.py",
                                             "tests/unit/test_sglang_update_protocol.py",
                                             "tests/unit/test_retry_boundaries.py",
                                             "tests/unit/test_sglang_release_tags.py",
                                             "tests/unit/test_sglang_shutdown.py",
                                             # the transports check and feed the servers through the engine
                                             "tests/unit/test_transport_sglang.py", "tests/unit/test_transport_disk.py",
                                             "tests/unit/test_sglang_router.py"],
    # The gloo tests run the collectives on real ranks (SPAWNED below reruns the survivors against them).
    "megatron_rl/collectives.py": ["tests/unit/test_collectives.py", "tests/dist/test_host_collectives.py",
                                   "tests/dist/test_weight_group_rendezvous.py"],
    "megatron_rl/rewards/runner.py": ["tests/unit/test_rewards_worker.py", "tests/unit/test_rewards_runner.py",
                                      "tests/unit/test_rewards_pool.py"],
    "megatron_rl/data/loader.py": ["tests/unit/test_data_loader.py", "tests/unit/test_data_datasets.py"],
    "megatron_rl/actor/packing.py": ["tests/unit/test_actor_packing.py"],
}


# module -> {function: tests that reach it only in processes they spawn (gloo ranks, torchrun)}; "*"
# stands for the module's other functions (without it, the functions not named are not rerun). mutmut maps a test to the functions it saw called in its
# own process, so these functions would be "no tests", or tested only by a one-process shortcut;
# after the ordinary run, each mutant that survived it or had no test is run again with its
# function's spawned tests added.
_HOST_DIST = "tests/dist/test_host_collectives.py::"
SPAWNED: dict[str, dict[str, list[str]]] = {
    "megatron_rl/collectives.py": {
        "make_host_groups": [_HOST_DIST + "test_collectives_on_four_processes_use_group_ranks_where_they_must",
                             _HOST_DIST + "test_host_groups_wait_as_long_as_their_own_timeout",
                             _HOST_DIST + "test_a_one_rank_world_needs_no_host_groups"],
        "rendezvous_group_as_rank0": ["tests/dist/test_weight_group_rendezvous.py"],
        "destroy_group": ["tests/dist/test_weight_group_rendezvous.py"],
        "*": [_HOST_DIST + "test_collectives_on_two_processes",
              _HOST_DIST + "test_collectives_on_four_processes_use_group_ranks_where_they_must"],
    },
}
SPAWNED["megatron_rl/collectives.py"]["gloo_subgroup"] = SPAWNED["megatron_rl/collectives.py"]["make_host_groups"]
# The phases' data-parallel reductions (a one-process run reduces nothing): DP=2 against one process.
SPAWNED["megatron_rl/loop/phases.py"] = {
    name: ["tests/dist/test_phases_dp.py"]
    for name in ("update_policy", "_advantages", "_denominator", "_reduced_means", "_reduce_sum", "_reference",
                 "_kl_in_reward", "_calibrate", "_length_metrics", "_rollout_metrics", "_component_means",
                 "_count_nonfinite")}
# build_rollout's placement path with more than one rank: owner and client on one host; then the
# built runs of one host (DP=2) and of two hosts (TP=2 x DP=2: an owner at rank 2, TP peers as IPC peers).
SPAWNED["megatron_rl/loop/build.py"] = {name: ["tests/dist/test_build_rollout_ranks.py",
                                               "tests/dist/test_build_run_ranks.py"]
                                       for name in ("build_rollout", "wire_ipc_gather")}
# build_run: a colocated host's owner and client wired and synced (DP=2); the loop on TP=2 x DP=1, and DP=2
SPAWNED["megatron_rl/loop/build.py"]["build_run"] = [
    "tests/dist/test_build_run_ranks.py", "tests/dist/test_rl_loop_ranks.py",
    "tests/e2e/test_rl_parallel.py::test_model_parallel_run_matches_one_process"
    "[parallel.pipeline_model_parallel_size=2]"]  # PP=2 under torchrun
SPAWNED["megatron_rl/loop/phases.py"].update({
    "assert_same_across_model_parallel": ["tests/dist/test_calib_model_parallel.py"],  # TP=2 ranks
    # DP=2 reduces the histogram; the TP=2 loop calibrates and compares (L, H) across the replica
    "_calibrate": ["tests/dist/test_phases_dp.py", "tests/dist/test_rl_loop_ranks.py"],
    "_histogram_payload": ["tests/e2e/test_calib_dump.py"],  # rebuilt by hand from a run's dump (a subprocess)
    # TP=2: only the engine rank samples and scores; its peer receives both (and DP=2 shards)
    **{name: ["tests/dist/test_rl_loop_ranks.py"]
       for name in ("_broadcast_from_engine_rank", "_score_on_engine_rank", "_sample_round", "_shard")},
    "generate": ["tests/dist/test_rl_loop_grid.py"],  # DP=2 dynamic sampling: each replica's share of the kept groups
})
# The reward worker's daemon flag shows only in an interpreter's exit: a script run as a subprocess.
SPAWNED["megatron_rl/rewards/runner.py"] = {
    "RewardWorker.start": ["tests/unit/test_rewards_worker.py::test_a_script_that_never_closes_its_runner_still_exits"]}
# The colocated tensor transport's gather: its ranks are processes (a host's GPUs), two in the test.
SPAWNED["megatron_rl/sync/sglang_transport.py"] = {
    name: ["tests/dist/test_ipc_gather.py"]
    for name in ("GlooGather.__init__", "GlooGather.__call__", "GlooGather.done", "ipc_peer", "payloads_for_server",
                 "SGLangTensorTransport.__init__", "SGLangTensorTransport.send")}
SPAWNED_LIMIT_S = 600.0  # one mutant's run of its spawned tests (a passing run: 20-140 s on 2 cores)


def _setup_cfg(module: str, tests: list[str]) -> str:
    lines = "\n    ".join
    return (
        "[mutmut]\n"
        "source_paths = megatron_rl\n"
        f"only_mutate = {module}\n"
        f"pytest_add_cli_args_test_selection =\n    {lines(tests)}\n"
        "pytest_add_cli_args =\n    -p\n    no:cacheprovider\n"
        "also_copy =\n    examples\n    pytest.ini\n    Makefile\n    setup.py\n"
        # torch (threads, its allocator) is not fork-safe once a test ran in the parent
        "process_isolation = forkserver\n"
        "use_git_change_detection = false\n"
        # A mutant's limit is 15 x its tests' measured time + this: the forked run also pays for
        # fixtures (a gloo group, a server double) on a loaded machine.
        "timeout_constant = 60\n"
    )


def _scratch(module: str, tests: list[str]) -> Path:
    """A copy of the project for one module (refreshed sources; mutmut's results are kept)."""
    work = WORK / module.replace("/", "__").removesuffix(".py")
    work.mkdir(parents=True, exist_ok=True)
    for name in COPY:
        src, dst = ROOT / name, work / name
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    (work / "setup.cfg").write_text(_setup_cfg(module, tests))
    return work


def _results(work: Path) -> dict[str, str]:
    """mutant name -> status, as `mutmut results --all true` reports them."""
    out = subprocess.run([MUTMUT, "results", "--all", "true"], cwd=work,
                         capture_output=True, text=True, check=True).stdout
    pairs = (line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)
    return {name: status for name, status in pairs}


def _plain_name(function: str) -> str:
    """mutmut's mangled name (`pkg.mod.x_fn`, `pkg.mod.xǁClassǁmethod`) -> `fn` / `method`."""
    return function.rsplit(".", 1)[-1].rsplit("ǁ", 1)[-1].removeprefix("x_")


def _spawned_tests(spawned: dict[str, list[str]], mutant: str) -> list[str] | None:
    """A mutant's spawned tests: by `Class.method`, then by the plain function or method name,
    then the module's "*" (None: the function has none)."""
    mangled = mutant.partition("__mutmut_")[0].rsplit(".", 1)[-1]
    parts = mangled.split("ǁ")
    keys = [f"{parts[1]}.{parts[2]}"] if len(parts) == 3 else []
    for key in [*keys, _plain_name(mangled), "*"]:
        if key in spawned:
            return spawned[key]
    return None


def _run_spawned(work: Path, env: dict, module: str, statuses: dict[str, str], max_children: int) -> dict[str, str]:
    """Run each surviving (or untested) mutant of a function listed in SPAWNED against that
    function's multi-process tests, and return the statuses with theirs updated.

    mutmut cannot map these tests (the calls happen in the ranks it spawns, not in its process), and
    mutmut 3.8 drops from its map every test its own selection does not list, so the tests run
    here, outside its runner (`_judge_outside`); the spawned ranks inherit MUTANT_UNDER_TEST with
    the environment."""
    spawned = SPAWNED[module]
    return _judge_outside(work, env, module, statuses, max_children, "spawned.log",
                          lambda name: _spawned_tests(spawned, name), ("no tests", "survived"))


def _confirm_survivors(work: Path, env: dict, module: str, statuses: dict[str, str],
                       max_children: int) -> dict[str, str]:
    """Run each survivor once more against the tests mutmut mapped to its function, outside
    mutmut's runner. mutmut 3.8's forkserver runner has reported a mutant surviving that the same
    tests kill when pytest runs them on it (SGLangNcclTransport.close__mutmut_7, fifth round): a
    survivor is confirmed before anyone triages it."""
    stats = json.loads((work / "mutants" / "mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
    return _judge_outside(work, env, module, statuses, max_children, "confirmed.log",
                          lambda name: _mapped_tests(stats, name), ("survived",))


def _mapped_tests(tests_by_function: dict[str, list[str]], mutant: str) -> list[str] | None:
    """The tests mutmut's stats map to a mutant's function (None: none)."""
    return sorted(tests_by_function.get(mutant.partition("__mutmut_")[0], [])) or None


def _judge_outside(work: Path, env: dict, module: str, statuses: dict[str, str], max_children: int,
                   log_name: str, tests_for, judged: tuple[str, ...]) -> dict[str, str]:
    """Run each mutant whose status is in `judged` and which has tests (`tests_for(name)`, None:
    none) against them: pytest in the mutated copy with MUTANT_UNDER_TEST set. A failing run kills
    the mutant; a run past SPAWNED_LIMIT_S is a timeout. `.mutate/<module>/<log_name>` keeps each
    verdict under the sha256 of the module's source, and a resumed run keeps the kills made on the
    same source (tests only get stronger); survivors are judged again."""
    from concurrent.futures import ThreadPoolExecutor

    source = hashlib.sha256((ROOT / module).read_bytes()).hexdigest()
    done = _earlier_kills(work / log_name, source)
    todo = sorted(name for name, status in statuses.items() if status in judged
                  and tests_for(name) is not None and name not in done)

    def judge(name: str) -> tuple[str, str]:
        tests = tests_for(name)
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=work / "mutants", env=dict(env, MUTANT_UNDER_TEST=name),
                                  capture_output=True, text=True, timeout=SPAWNED_LIMIT_S)
        except subprocess.TimeoutExpired:
            return name, "timeout"
        if proc.returncode not in (0, 1):  # 2-5: interrupted, internal error, usage, nothing collected
            raise RuntimeError(f"{name}: pytest exited {proc.returncode} on {tests}:\n{proc.stdout[-2000:]}")
        return name, "killed" if proc.returncode else "survived"

    statuses = {name: done.get(name, status) for name, status in statuses.items()}
    with ThreadPoolExecutor(max_children) as pool, open(work / log_name, "a") as log:
        log.write(f"# source {source}\n")
        for name, status in pool.map(judge, todo):
            log.write(f"{name}: {status}\n")
            log.flush()  # progress is readable while the stage runs
            statuses[name] = status
    return statuses


def _earlier_kills(log: Path, source: str) -> dict[str, str]:
    """The mutants that earlier stages outside mutmut's runner killed (or timed out) on this source
    (its sha256), from their log: "# source HASH" starts a stage, "NAME: STATUS" is a verdict."""
    kills: dict[str, str] = {}
    current = None
    for line in log.read_text().splitlines() if log.is_file() else []:
        if line.startswith("# source "):
            current = line.removeprefix("# source ")
        elif current == source and line.endswith((": killed", ": timeout")):
            name, status = line.rsplit(": ", 1)
            kills[name] = status
    return kills


def _sample(work: Path, env: dict, n: int, seed: int, max_children: int, timeout_s: float) -> list[str]:
    """Generate the module's mutants and its test map without running any (a run filtered on a
    name that matches nothing stops right after them), then draw n names, seeded."""
    for attempt in range(2):
        with open(work / "mutmut.log", "a" if attempt else "w") as log:
            subprocess.run([MUTMUT, "run", "--max-children", str(max_children), "no-such-mutant"],
                           cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        names = sorted(_results(work))
        if names and (work / "mutants" / "mutmut-stats.json").exists():
            return sorted(random.Random(seed).sample(names, min(n, len(names))))
    raise RuntimeError(f"mutmut generated no mutants in {work} (see its mutmut.log)")


def run_module(module: str, tests: list[str], max_children: int, timeout_s: float,
               sample: int | None = None, seed: int = 0, rerun: bool = False) -> dict:
    """One module: every mutant, or `sample` of them drawn with `seed` (an estimate of the rate for
    a module whose tests are end-to-end runs), or (`rerun`) the last run's survivors again."""
    work = _scratch(module, tests)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(work / "mutants"))
    t0 = time.monotonic()
    if rerun:  # after triage: the survivors (and mutants with no test) of the last run, against today's tests
        chosen = sorted(n for n, st in _results(work).items() if st in ("survived", "no tests"))
        if not chosen:
            raise SystemExit(f"{module}: nothing to rerun in {work}")
    else:
        chosen = _sample(work, env, sample, seed, max_children, timeout_s) if sample else []
    for attempt in range(2):
        with open(work / "mutmut.log", "a" if attempt or chosen else "w") as log:
            try:
                proc = subprocess.run([MUTMUT, "run", "--max-children", str(max_children), *chosen],
                                      cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
            except subprocess.TimeoutExpired:  # mutmut keeps its verdicts: the same command resumes
                every = _results(work)
                judged = sum(status != "not checked" for status in every.values())
                raise SystemExit(f"{module}: mutmut stopped at the wall-clock limit (--timeout-s {timeout_s:.0f}) "
                                 f"with {judged} of {len(every)} mutants judged; run the same "
                                 "command again to resume") from None
        every = _results(work)
        statuses = {name: every[name] for name in chosen} if chosen else every  # a sample's, or a rerun's
        # mutmut 3.8's first run in a fresh folder (the one that generates the mutants) can stop at
        # its stats step with "could not find any test case for any mutant" and every mutant "not
        # checked"; the next run, which finds the mutants generated, maps and checks them.
        if any(status != "not checked" for status in statuses.values()):
            break
    if proc.returncode:  # e.g. "Failed to run clean test": the statuses are an earlier run's
        raise RuntimeError(f"{module}: mutmut exited {proc.returncode}; see {work / 'mutmut.log'}")
    if module in SPAWNED:
        statuses = _run_spawned(work, env, module, statuses, max_children)
    statuses = _confirm_survivors(work, env, module, statuses, max_children)
    counts = Counter(statuses.values())
    return {"module": module, "tests": tests, "seconds": round(time.monotonic() - t0, 1),
            "returncode": proc.returncode, "mutants": len(statuses),
            "sampled_from": len(every) if sample and not rerun else None,
            "killed": counts["killed"], "survived": counts["survived"], "timeout": counts["timeout"],
            "other": {k: v for k, v in counts.items() if k not in ("killed", "survived", "timeout")},
            "survivors": sorted(n for n, s in statuses.items() if s == "survived")}


def _print(rows: list[dict]) -> None:
    print(f"{'module':45s} {'mutants':>7s} {'killed':>6s} {'surv':>5s} {'tmout':>5s} {'rate':>6s} {'s':>7s}")
    for r in rows:
        judged = r["killed"] + r["survived"] + r["timeout"]
        rate = (r["killed"] + r["timeout"]) / judged if judged else float("nan")
        print(f"{r['module']:45s} {r['mutants']:7d} {r['killed']:6d} {r['survived']:5d} {r['timeout']:5d} "
              f"{rate:6.1%} {r['seconds']:7.0f}")
        for name in r["survivors"]:
            print(f"    survived: {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="paths of MODULES keys (default: all)")
    parser.add_argument("--list", action="store_true", help="print the module -> tests map and exit")
    parser.add_argument("--max-children", type=int, default=2, help="parallel mutant runs (default 2)")
    parser.add_argument("--timeout-s", type=float, default=4 * 3600,
                        help="wall-clock limit of mutmut's run per module (phases in full: about 65 minutes)")
    parser.add_argument("--sample", type=int, default=None,
                        help="run this many mutants per module, drawn at random (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed (with --sample)")
    parser.add_argument("--rerun-survivors", action="store_true",
                        help="rerun each module's survivors of its last run against the current tests (after triage)")
    args = parser.parse_args(argv)
    if args.list:
        for module, tests in MODULES.items():
            print(module, "->", " ".join(tests))
        return 0
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        raise SystemExit(f"not in tools/mutate.py MODULES: {unknown}")
    rows = []
    for module in args.modules or MODULES:
        rows.append(run_module(module, MODULES[module], args.max_children, args.timeout_s, args.sample, args.seed,
                                   args.rerun_survivors))
        _record(rows[-1])  # each module as it finishes: a long pass that is stopped keeps what it measured
        _print(rows[-1:])
    print()
    _print(rows)
    return 0


def _record(row: dict) -> None:
    WORK.mkdir(exist_ok=True)
    summary = WORK / "summary.json"
    rows = {r["module"]: r for r in json.loads(summary.read_text())} if summary.exists() else {}
    rows[row["module"]] = row
    summary.write_text(json.dumps(list(rows.values()), indent=1))


if __name__ == "__main__":
    sys.exit(main())
