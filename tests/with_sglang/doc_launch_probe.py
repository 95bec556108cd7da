"""Run in a fresh interpreter by test_doc_launches.py (SGLang applies plug-ins once per
process): load SGLang's plug-ins as its launcher does, then parse each launch command's
arguments with SGLang's own command-line parser and resolve them, printing one JSON line.
argv[1]: a JSON list of [environment, argument list] pairs (the variables set before the command
and what follows `python -m sglang.launch_server`); each launch's variables are set while it
resolves and removed after."""
import argparse
import json
import os
import sys


def main() -> None:
    import sglang.srt.plugins as plugins
    from sglang.srt.server_args import ServerArgs

    plugins.load_plugins()
    report = []
    for env, argv in json.loads(sys.argv[1]):
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        try:
            args = ServerArgs.from_cli_args(parser.parse_args(argv))
            args.resolve_once()
            r = args.resolved_dict()
            report.append({"ok": True, "resolved": {k: r.get(k) for k in (
                "speculative_algorithm", "speculative_eagle_topk", "speculative_num_steps",
                "speculative_num_draft_tokens", "tp_size", "dsv4_attn_backend")}})
        except BaseException as exc:  # what SGLang's launcher would report (SystemExit for a bad flag)
            report.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print(json.dumps(report))


if __name__ == "__main__":
    main()
