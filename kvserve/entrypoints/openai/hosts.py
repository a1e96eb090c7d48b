"""``Host`` header allow-list (``--allowed-hosts``): a defence against DNS rebinding.

A web page can make a browser send requests to ``http://attacker.example:8000`` after
pointing that name at 127.0.0.1; the browser then talks to a server on the victim's own
machine, and only the ``Host`` header (``attacker.example:8000``) gives it away. A server
without an API key therefore accepts only loopback host names by default. With a key the
default is ``*`` (any host): the key already stops such requests.

Patterns: ``*`` (any host), an exact name or address (``api.example.com``, ``10.0.0.5``,
``::1``), or ``*.example.com`` (any subdomain). Matching ignores the port and case.
The open paths (``/health``, ``/ping``, ``/version``, ``/metrics`` unless protected) are not
checked, so that probes and scrapers that use the pod IP keep working.

Starlette's ``TrustedHostMiddleware`` does the same matching but answers in plain text; this
check runs inside the server's gate middleware and answers with OpenAI's JSON error body.
"""

from __future__ import annotations

from typing import Optional, Sequence

#: The default allow-list when no API key is set.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(api_key: Optional[str], bind_host: Optional[str] = None) -> list[str]:
    """``["*"]`` with an API key; else the loopback names plus ``bind_host`` when it is a
    specific address (not ``0.0.0.0`` / ``::`` / empty)."""
    if api_key:
        return ["*"]
    hosts = list(LOOPBACK_HOSTS)
    if bind_host and bind_host not in ("0.0.0.0", "::", "") and bind_host.lower() not in hosts:
        hosts.append(bind_host.lower())
    return hosts


def parse_allowed_hosts(value: Optional[str]) -> Optional[list[str]]:
    """``--allowed-hosts`` text (comma-separated) -> patterns; None stays None (the default).

    Raises:
        ValueError: an empty list or an empty pattern.
    """
    if value is None:
        return None
    items = [h.strip().lower() for h in value.split(",")]
    if not items or any(not h for h in items):
        raise ValueError(f"--allowed-hosts: give comma-separated host names or '*', got {value!r}")
    return items


def host_name(header: str) -> str:
    """The name part of a ``Host`` header value: ``"[::1]:8000"`` -> ``"::1"``,
    ``"Example.com:80"`` -> ``"example.com"``."""
    h = header.strip().lower()
    if h.startswith("["):  # IPv6 literal
        end = h.find("]")
        return h[1:end] if end > 0 else h
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def host_allowed(header: Optional[str], patterns: Sequence[str]) -> bool:
    """True if the ``Host`` header value matches one of ``patterns`` (see the module docstring).

    A missing or empty header matches only ``*`` (HTTP/1.1 requires one).
    """
    if "*" in patterns:
        return True
    if not header:
        return False
    name = host_name(header)
    for p in patterns:
        if p.startswith("*."):
            if name.endswith(p[1:]) and len(name) > len(p) - 1:
                return True
        elif name == p:
            return True
    return False
