"""What must never be shown: a URL's password and the secrets of an engine's command line, masked as ``***``;
files that hold commands or engine errors written readable by their owner only.

One masking for every output. The proxy's ``/health``, banner, logs and configuration errors show engine URLs
through ``redact_url``; the bench (``results.jsonl``, ``verdict.json``, the reports, the switch plan, ``tune``'s
summary, its progress lines, each engine log's ``+ COMMAND`` header) masks commands and URLs once, where they enter
its records (``redact_command``), so every renderer gets the masked form and none has to remember it.

Masked in a command line (the value after the flag, ``--flag VALUE`` or ``--flag=VALUE``, quoted or not):

- flags whose name ends in ``api-key``, ``token``, ``secret``, ``password`` or ``passwd`` (llama-server's
  ``--api-key`` and ``-hft``/``--hf-token``, SGLang's ``--api-key`` and ``--admin-api-key``, vLLM's ``--api-key``
  and ``--hf-token``, ``--ssl-keyfile-password``); a value that starts with ``-`` is the next flag (vLLM's bare
  ``--hf-token`` uses the cached login) and is kept. ``--api-key-file PATH`` is kept: a path says where the key
  lives, which is what a reader needs;
- ``NAME=VALUE`` words whose name ends in ``TOKEN``, ``KEY``, ``SECRET``, ``PASSWORD`` or ``PASSWD`` (the leading
  environment of a launch: ``HF_TOKEN=hf_…``, ``OPENAI_API_KEY=…``, also as ``--launch b=HF_TOKEN=…``; ``docker -e``
  alike);
- ``Bearer VALUE`` (an ``Authorization`` header passed on a command line);
- every URL's password (``user:***@``).

Masking is idempotent and keeps the command's shape: ``shlex.split`` of a masked command gives the same words with
``***`` for each secret, so the tools that read a launch's flags (model path, memory share, port) read it alike.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MASK = "***"

#: a password in a URL's userinfo (``user:PASSWORD@``), also where the URL is malformed (no scheme, one slash)
_PASSWORD = re.compile(r"([^\s/:@]*):[^\s/@]*@")
#: a value on a command line: quoted (either quote) or a run of non-blanks
_VALUE = r"""(?:'[^']*'|"[^"]*"|[^\s'"]\S*)"""
#: a flag whose value is a secret (the whole word)
_FLAG_NAME = r"--?(?:[\w-]*[-_])?(?:api[-_]key|token|secret|password|passwd)|-hft"
_SECRET_FLAG = re.compile(r"(?<!\S)(" + _FLAG_NAME + r")(=|\s+)(?!-)(" + _VALUE + ")", re.IGNORECASE)
_IS_SECRET_FLAG = re.compile(_FLAG_NAME, re.IGNORECASE)
_SECRET_ENV = re.compile(r"(?<![^\s'\"=])([A-Za-z_][A-Za-z0-9_]*(?:TOKEN|KEY|SECRET|PASSWORD|PASSWD))=(" + _VALUE + ")")
_BEARER = re.compile(r"(Bearer\s+)[^\s'\"]+", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (``http://user:***@host``): engine URLs appear in
    ``/health``, the start banner, logs and configuration errors, none of which may show a secret. Works on
    malformed URLs too (``htp://user:pw@host``, ``user:pw@host``): anything shaped ``name:secret@``."""
    return _PASSWORD.sub(r"\1:***@", url) if "@" in url else url


def _masked(m: re.Match[str]) -> str:
    value = m.group(m.lastindex or 0)
    quote = value[0] if value[:1] in ("'", '"') else ""
    return m.group(0)[: m.start(m.lastindex or 0) - m.start(0)] + f"{quote}{MASK}{quote}"


def redact_command(command: str) -> str:
    """``command`` (a launch's command line, an ``enginemeter`` argument, any text that may hold one) with every
    secret the module docstring lists replaced by ``***``."""
    out = _SECRET_FLAG.sub(_masked, command)
    out = _SECRET_ENV.sub(_masked, out)
    out = _BEARER.sub(r"\1" + MASK, out)
    return redact_url(out)


def redact_optional(text: str | None) -> str | None:
    """``redact_command`` of ``text``; None stays None."""
    return None if text is None else redact_command(text)


def redact_argv(argv: list[str]) -> list[str]:
    """A command's words, each masked, and a secret flag's value masked in the word after it."""
    out = [redact_command(w) for w in argv]
    for i, w in enumerate(argv[:-1]):
        if _IS_SECRET_FLAG.fullmatch(w) and not argv[i + 1].startswith("-"):
            out[i + 1] = MASK
    return out


def private_file(path: Path) -> Path:
    """Make ``path`` (created if missing) readable and writable by its owner only (0600), as the logs are;
    returns it. Files that hold engine errors or command lines are made so before anything is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (UTF-8, replacing it) with mode 0600."""
    private_file(path).write_text(text, encoding="utf-8")
