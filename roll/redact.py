"""Recipe keys that hold credentials, kept out of logs and saved files.

A key is secret when its name ends in ``token`` (``hub_token``; not ``calculate_per_token_loss``) or holds
``secret``, ``password``, ``passwd``, ``api_key``/``apikey`` or ``credential``. Its value is replaced by
:data:`REDACTED` in the launcher's command-line log, in ``--print-config``, and in the
``training_args.json`` both backends write into ``output_dir`` and every checkpoint (as JSON: HF's
pickled ``training_args.bin`` is not written).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

ARGUMENTS_FILE = "training_args.json"
SECRETS_ENV = "ROLL_SECRET_ARGS"
"""How roll-train's launcher hands secret command-line keys to the ranks: in their environment (readable by
the user only), not on their command lines (which launchers log and ``ps`` shows to every user)."""
REDACTED = "<redacted>"
_SECRET = re.compile(r"(^|_)token$|secret|password|passwd|api_?key|credential", re.IGNORECASE)


def is_secret(key: str) -> bool:
    return bool(_SECRET.search(key.lstrip("-").replace("-", "_")))


def redact(value: Any) -> Any:
    """``value`` with the values of secret keys (at any depth of dicts and lists) replaced; a set secret
    becomes :data:`REDACTED`, an unset one (None, "") stays as it is."""
    if isinstance(value, dict):
        return {key: (REDACTED if is_secret(str(key)) and item not in (None, "") else redact(item))
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(item) for item in value)
    return value


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the values of secret keys replaced: ``key=v``, ``--key=v`` and ``--key v``."""
    out, hide_next = [], False
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if hide_next:
            out.append(REDACTED)
        elif sep and is_secret(key):
            out.append(f"{key}={REDACTED}")
        else:
            out.append(arg)
        hide_next = not sep and arg.startswith("--") and is_secret(arg)
    return out


def split_secrets(argv: list[str]) -> tuple[list[str], list[str]]:
    """(``argv`` without secret keys, the secret keys as ``key=value``), for :data:`SECRETS_ENV`."""
    public, secret, i = [], [], 0
    while i < len(argv):
        key, sep, value = argv[i].partition("=")
        if is_secret(key) and (sep or (argv[i].startswith("--") and i + 1 < len(argv))):
            secret.append(f"{key.lstrip('-')}={value}" if sep else f"{key.lstrip('-')}={argv[i + 1]}")
            i += 1 if sep else 2
            continue
        public.append(argv[i])
        i += 1
    return public, secret


def inherited_secrets() -> list[str]:
    """The secret ``key=value`` arguments roll-train's launcher put in :data:`SECRETS_ENV`."""
    if "ROLL_LAUNCHED" not in os.environ:  # roll.launch.LAUNCHED_ENV: only a rank it started inherits them
        return []
    return list(json.loads(os.environ.get(SECRETS_ENV) or "[]"))


def save_arguments(arguments: dict, folder: str) -> str:
    """Write ``folder/training_args.json``: the run's resolved arguments, secrets redacted (no pickle)."""
    path = os.path.join(folder, ARGUMENTS_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(redact(arguments), fh, indent=2, sort_keys=True, default=str)
    return path
