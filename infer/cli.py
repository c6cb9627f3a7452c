"""`infer`: run, prepare and measure MoE models whose experts stream from SSD."""

import importlib
import os
import sys

# command -> module with a main(argv) -> int
COMMANDS = {
    "run": ("infer.run", "generate text with experts streamed through iod"),
    "prep": ("infer.prep.prep", "convert an mlx-lm MoE model into a prep folder"),
    "verify": ("infer.prep.verify", "check every expert record of a prep folder"),
    "synth": ("infer.synth.synth", "build a random-weight model of a real architecture"),
    "train": ("infer.train.train", "train a small MoE language model on a text corpus"),
    "routing": ("infer.tools.routing", "routing statistics of a model over a text"),
    "bench": ("infer.tools.bench", "compare resident, streaming and iod decoding"),
    "serve": ("infer.serve", "OpenAI-compatible HTTP server on a shared iod"),
}


def usage() -> str:
    lines = ["usage: infer [--version] COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:8s} {help}" for name, (_, help) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from infer.args import version

        print(f"infer: {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"infer: unknown command {name!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[name][0])
        return module.main(rest)
    except KeyboardInterrupt:  # Ctrl-C before the command's own handler is in place
        print(f"\ninfer {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`infer ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a file, folder or disk the command could not use: one line, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"infer {name}: {where}{e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
