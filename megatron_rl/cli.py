"""Command line: `megatron-rl train CONFIG.yaml [section.key=value ...]`; options and overrides in any order."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from megatron_rl.config import dump_config, load_config

EPILOG = """examples:
  megatron-rl train examples/tiny/fp8_calibrated.yaml
  megatron-rl train examples/tiny/bf16.yaml train.num_steps=10 log.dir=runs/bf16
  megatron-rl train examples/tiny/fp8_calibrated.yaml train.num_steps=80   # continues its run in log.dir
  megatron-rl train examples/tiny/fp8_calibrated.yaml --overwrite          # deletes it and starts afresh
  megatron-rl eval examples/tiny/fp8_calibrated.yaml --checkpoint runs/tiny_fp8_calibrated/checkpoints
  torchrun --nproc-per-node 2 -m megatron_rl.train CONFIG.yaml parallel.tensor_model_parallel_size=2
  megatron-rl plan examples/qwen3_8b_grpo/fp8_calibrated.yaml --nodes 4 rollout.max_new_tokens=8192 --gpu-mem-gb 80
  megatron-rl launch --dry-run examples/qwen3_8b_grpo/fp8_calibrated.yaml --nodes 4 --gpus-per-node 8
  megatron-rl config examples/qwen3_8b_grpo/fp8.yaml eval.datasets.0.temperature=0.6
  megatron-rl doctor --json doctor.json examples/qwen3_8b_grpo/fp8_calibrated.yaml
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl",
        description="Full-pipeline FP8 RL (GRPO / DAPO) on Megatron-Core, stable with Calibrated Clipping.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run RL training from a YAML config",
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", help="YAML config file (see examples/)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.num_steps=10")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in log.dir from its latest checkpoint (checkpoint.resume=true; "
                            "the default, auto, does the same and starts a run where there is none)")
    train.add_argument("--overwrite", action="store_true",
                       help="delete the run in log.dir (metrics, checkpoints, config) and start afresh")
    _add_plan_parser(sub)
    _add_eval_parser(sub)
    _add_config_parser(sub)
    _add_doctor_parser(sub)
    sub.add_parser("launch", add_help=False,
                   help="Slurm placement (--dry-run) or this host's part of it")
    return parser


def _add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="score a checkpoint on the eval datasets")
    ev.add_argument("config", help="YAML config file with an eval section (docs/eval.md)")
    ev.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. eval.precision=both")
    ev.add_argument("--checkpoint", default="",
                    help="a step folder, a checkpoints folder (its latest) or its latest / best file; "
                         "default: model.hf_dir (or the tiny model) as built")
    ev.add_argument("--output", default="", help="folder of eval_results.json (default <log.dir>_eval)")


def _add_config_parser(sub) -> None:
    cfg = sub.add_parser("config", help="print the resolved config with every default (YAML)")
    cfg.add_argument("config", help="YAML config file (see examples/)")
    cfg.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. eval.datasets.0.temperature=0.6")
def _add_doctor_parser(sub) -> None:
    doctor = sub.add_parser("doctor", help="check this node's GPU stack; exit 1 on a blocker")
    doctor.add_argument("config", nargs="?", default=None,
                        help="YAML config whose needs to check (SGLang, ports, recipe); default: none")
    doctor.add_argument("overrides", nargs="*", help="section.key=value overrides")
    doctor.add_argument("--json", default=None, metavar="PATH", help="also write the checks as a JSON list")


def _add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="memory plan per GPU; exit 1 when it does not fit")
    plan.add_argument("config", help="YAML config file (see examples/)")
    plan.add_argument("overrides", nargs="*", help="section.key=value overrides")
    plan.add_argument("--nodes", type=int, default=1, help="nodes of the job (default 1)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    plan.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory per GPU in GB (default 80)")
    plan.add_argument("--rollout-nodes", type=int, default=None,
                      help="disaggregated: nodes serving SGLang (default half of --nodes)")
    plan.add_argument("--hf-config", default=None,
                      help="HF config.json to plan with instead of model.hf_dir's")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def parse_args(argv: list[str]):
    """Like build_parser().parse_args, but a subcommand's options and `key=value` overrides may
    come in any order after CONFIG (argparse's intermixed parsing, which subparsers lack: the
    subcommand's own parser reads everything after the subcommand's name)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if not argv or argv[0] not in sub.choices or argv[0] == "launch":
        return parser.parse_args(argv)  # --help, or argparse's error naming the choices
    args = sub.choices[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # its own parser: megatron_rl.cluster.launch.build_parser
        from megatron_rl.cluster import launch
        return launch.main(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        if args.command == "plan":
            from megatron_rl.cluster.plan import main as plan_main
            return plan_main(args)
        if args.command == "doctor":
            from megatron_rl.cluster import doctor
            config, overrides = args.config, list(args.overrides)
            if config and "=" in config and not os.path.isfile(config):  # no CONFIG, overrides only
                config, overrides = None, [config, *overrides]
            cfg = load_config(config, overrides) if config or overrides else None
            return doctor.report(doctor.run_checks(cfg), args.json)
        flags = {"resume": "checkpoint.resume=true", "overwrite": "checkpoint.overwrite=true"}
        overrides = list(args.overrides) + [o for flag, o in flags.items() if getattr(args, flag, False)]
        cfg = load_config(args.config, overrides)
        from megatron_rl.loop import preflight  # every input checked, log.dir's run decided: no heavy import

        if args.command == "train":
            cfg = preflight.prepare_run(cfg)
        elif args.command == "eval":
            preflight.check_inputs(cfg)
    except ValueError as err:
        print(f"megatron-rl: error: {err}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(dump_config(cfg), end="")
        return 0
    if args.command == "eval":
        from megatron_rl.loop.evaluate import evaluate_checkpoint
        try:
            evaluate_checkpoint(cfg, args.checkpoint, args.output)
        except ValueError as err:
            print(f"megatron-rl: error: {err}", file=sys.stderr)
            return 2
        return 0
    from megatron_rl.train import run  # heavy imports (megatron) only after every check has passed
    run(cfg, prepared=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
