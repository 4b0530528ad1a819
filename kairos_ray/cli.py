"""The ``kairos`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from kairos_ray import __version__
from kairos_ray.config import ConfigError, KairosConfig, load_config

DESCRIPTION = """\
Kairos-Ray: load-aware prefill deflection for disaggregated LLM serving.

For each request, Kairos estimates the time to first token on the prefill
path and, for every decode node, builds the largest TBT-safe shrinking chunk
schedule; it runs the prefill on the decode node when that is clearly faster.
"""

EPILOG = """\
examples:
  kairos demo                          decide a burst of 12 requests on a 2P2D cluster
  kairos demo --policy sl:2048         the same burst under a static baseline
  kairos config show > kairos.yaml     write the default configuration
  kairos config check kairos.yaml      validate a configuration file
  kairos fit steps.csv -o profile.json fit the step-latency model to measured steps
"""


def _config(path: str | None) -> KairosConfig:
    return load_config(path) if path else KairosConfig()


def _cmd_demo(args: argparse.Namespace) -> int:
    from kairos_ray.demo import run_burst

    policy = _config(args.config).build_policy(args.policy)
    run_burst(policy, args.requests, args.seed, sys.stdout)
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(_config(args.config).model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _cmd_config_check(args: argparse.Namespace) -> int:
    load_config(args.file)
    print(f"{args.file}: ok")
    return 0


def _cmd_fit(args: argparse.Namespace) -> int:
    from kairos_ray.profiling.fit import fit, read_table

    result = fit(read_table(args.table), holdout=args.holdout, seed=args.seed)
    Path(args.output).write_text(result.model.to_json() + "\n")
    print(
        f"fitted on {result.num_train} steps; held-out MAPE {100 * result.holdout_mape:.2f} % "
        f"on {result.num_holdout} steps; wrote {args.output}"
    )
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kairos", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kairos-ray {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="decide a burst of requests on a 2P2D cluster and print each decision",
        description="Decide a seeded burst of requests on a busy 2P2D cluster with the scheduling core, "
        "updating the cluster view after every decision as the live router does.",
    )
    demo.add_argument("--policy", metavar="SPEC", help="kairos, pd, sq:<theta> or sl:<tokens> (default: from config)")
    demo.add_argument("--requests", type=_positive_int, default=12, metavar="N", help="requests in the burst (12)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths (0)")
    demo.add_argument("--config", metavar="FILE", help="Kairos configuration YAML (default: built-in defaults)")
    demo.set_defaults(func=_cmd_demo)

    config = commands.add_parser(
        "config", help="show or check a configuration", description="Show or check a configuration."
    )
    config_commands = config.add_subparsers(title="commands", metavar="COMMAND", required=True)
    show = config_commands.add_parser("show", help="print the effective configuration as YAML")
    show.add_argument("--config", metavar="FILE", help="configuration to load (default: built-in defaults)")
    show.set_defaults(func=_cmd_config_show)
    check = config_commands.add_parser("check", help="validate a configuration file")
    check.add_argument("file", metavar="FILE")
    check.set_defaults(func=_cmd_config_check)

    fit = commands.add_parser(
        "fit",
        help="fit the step-latency model (Eq. 4) to measured steps",
        description="Fit T_step(B, K, chi) to a CSV of measured steps "
        "(columns batch_size, kv_tokens, chunk_tokens, step_s) and report the held-out MAPE.",
    )
    fit.add_argument("table", metavar="TABLE.csv", help="measured steps")
    fit.add_argument("-o", "--output", required=True, metavar="PROFILE.json", help="where to write the fitted profile")
    fit.add_argument("--holdout", type=_fraction, default=0.2, help="share of steps held out for the MAPE (0.2)")
    fit.add_argument("--seed", type=int, default=0, help="seed of the hold-out split (0)")
    fit.set_defaults(func=_cmd_fit)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kairos: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"kairos: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
