"""`--config FILE.yaml` (vLLM's): a YAML mapping whose keys are long option names (`port`,
`max-model-len` or `max_model_len`, ...). Its options are put before the command line's, so a
flag given on the command line wins."""
from __future__ import annotations

import json
from pathlib import Path


def expand_config(argv: list[str]) -> list[str]:
    """`argv` with every `--config FILE` (or `--config=FILE`) replaced by the file's options,
    which go right after the subcommand name (argv[0])."""
    files, rest, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise ValueError("config: --config needs a YAML file")
            files.append(argv[i + 1])
            i += 2
            continue
        if a.startswith("--config="):
            files.append(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    if not files:
        return argv
    opts = [o for f in files for o in _options(Path(f))]
    return rest[:1] + opts + rest[1:]


def _options(path: Path) -> list[str]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"config: cannot read {path} ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config: {path} is not valid YAML ({e})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"config: {path} must hold a mapping of option names to values")
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        elif value is None:
            continue
        elif isinstance(value, dict):  # e.g. speculative-config
            out += [flag, json.dumps(value)]
        elif isinstance(value, list):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out
