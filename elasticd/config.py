"""The daemon's settings: defaults, a TOML file, ``ELASTICD_*`` environment variables and
command-line flags, in increasing order of precedence, validated once at start.

A bad value is a :class:`ConfigError` naming the setting, where it came from, what is wrong and
what would be right; ``elasticd`` prints it on one line and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pwd
import socket
import stat
import sys
import tomllib
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from elasticd.cluster.job_policy import JobPolicy

from elasticd.coordination.etcd import EtcdSettings, parse_endpoints
from elasticd.coordination.keys import check_name, check_prefix
from elasticd.rendezvous.rounds import check_grow
from elasticd.errors import InputError
from elasticd.replication.secret_strength import weak_secret

ENV_PREFIX = "ELASTICD_"


class ConfigError(InputError, ValueError):
    """A setting has a bad value; the message names it and says what to do."""


class SecretFileError(InputError, ValueError):
    """The cluster secret file is missing, not a file, too open, or unreadable."""


def read_secret_file(path: str) -> bytes:
    """Reads the cluster secret (first line, stripped) after checking the file itself.

    Refused: a missing path, a directory or other non-file, a file that group or others may
    access (anyone who reads it can join the cluster and forge replicas), and one owned by
    another user than the daemon's or root (its owner could change the secret).

    Raises:
        SecretFileError: one line saying what is wrong and what to do.
    """
    try:
        # Symbolic links are followed (secrets mounted by orchestrators are links); the checks
        # apply to the file reached. O_NONBLOCK: a FIFO planted there must not hang the start.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise SecretFileError(f"file {path!r} does not exist") from None
    except OSError as exc:
        raise SecretFileError(f"cannot read {path!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise SecretFileError(f"{path!r} is a directory: point cluster_secret_file at the "
                                  "file holding the secret")
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(f"{path!r} is not a regular file")
        if st.st_mode & 0o077:
            raise SecretFileError(f"{path!r} is accessible by group or others (mode "
                                  f"{stat.S_IMODE(st.st_mode):04o}): run `chmod 600 {path}`")
        if st.st_uid not in (0, os.geteuid()):
            raise SecretFileError(f"{path!r} is owned by uid {st.st_uid}, not by the daemon's "
                                  f"user (uid {os.geteuid()}) or root: chown it")
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.readline().strip()
    except OSError as exc:
        raise SecretFileError(f"cannot read {path!r}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT (port 0 picks a free one)")
    return host.strip("[]") or "0.0.0.0", int(port)


def _setting(default: Any, help: str, **kw: Any) -> Any:
    """A setting's field: its default, and its help (the flag's ``--help`` text, and its doc)."""
    if "default_factory" not in kw:
        kw["default"] = default
    return dataclasses.field(metadata={"help": help}, **kw)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything an ``elasticd`` process is told: each field's ``help`` (its metadata) says
    what it means, and is its flag's text in ``elasticd --help``."""

    node_id: str = _setting(None, "this node's name (default: host name)",
                            default_factory=lambda: socket.gethostname().split(".")[0])
    etcd: str = _setting("", "HOST:PORT[,HOST:PORT...] of etcd; omit to start a private one")
    prefix: str = _setting("/elasticd", "etcd key prefix of the cluster: daemons with the same "
                           "prefix form one cluster (default /elasticd)")
    listen: str = _setting("127.0.0.1:9400", "HOST:PORT for /metrics, /healthz, /status "
                           "(port 0: any)")
    lease_ttl: int = _setting(5, "seconds without a keep-alive after which etcd declares this "
                              "node dead (default 5)")
    loop_interval: float = _setting(1.0, "seconds between main loop cycles when nothing "
                                    "happens (default 1)")
    heartbeat_interval: float = _setting(0.0, "seconds between timed rewrites of the node "
                                         "record, for tools that read its heartbeat_at, at N/"
                                         "interval etcd writes per second (default 0: none; "
                                         "the lease, kept alive every TTL/3, carries liveness)")
    etcd_timeout: float = _setting(1.0, "seconds one etcd request may take (default 1, at most "
                                   "--lease-ttl)")
    outage_grace: float = _setting(30.0, "seconds to keep workers running while etcd is "
                                   "unreachable (default 30)")
    provisional_grace: float = _setting(0.0, "seconds a peer's expiry seen during this node's "
                                        "own outage stays provisional before it is recorded as "
                                        "a failure (default 0: 2 x lease TTL + 2)")
    events_retention: int = _setting(1000, "cluster events kept in etcd (default 1000)")
    etcd_user: str = _setting("", "etcd user (with --etcd-password)")
    etcd_password: str = _setting("", "prefer ELASTICD_ETCD_PASSWORD: flags are visible in ps")
    etcd_ca_cert: str = _setting("", "CA certificate of etcd's TLS")
    etcd_cert: str = _setting("", "client certificate for etcd (with --etcd-key and "
                              "--etcd-ca-cert)")
    etcd_key: str = _setting("", "client key for etcd")
    state_dir: str = _setting("", "job logs and the local socket (default /var/lib/elasticd/"
                              "NODE as root)")
    agent_restarts: int = _setting(10, "restarts in a row of a job's dead agent, with backoff "
                                   "(a newer committed step renews the count; default 10)")
    stop_grace: float = _setting(10.0, "seconds between SIGTERM and SIGKILL when stopping a "
                                 "job (default 10)")
    rdzv_last_call: float = _setting(1.0, "torchrun's last_call_timeout for the job's "
                                     "rendezvous: seconds a complete round waits for more "
                                     "(default 1)")
    rdzv_grow: str = _setting("immediate", "immediate: a returning or added node enters at "
                              "once (every node stops once; default); at-failure: it waits as "
                              "a spare for the next failure; interval:MIN: as at-failure, and "
                              "at most once every MIN minutes, at a committed step, it enters "
                              "at once")
    worker_start: str = _setting("warm", "warm: fork workers from a process that imported "
                                 "torch already (elasticd/agent/zygote.py; default); cold: a "
                                 "new interpreter per worker")
    shm_dir: str = _setting("", "tmpfs directory of checkpoint slots (default /dev/shm/"
                            "elasticd-NODE)")
    memory_cap_mib: int = _setting(0, "cap on checkpoint RAM (snapshots and peer replicas), "
                                   "MiB: a snapshot over it is skipped with a warning (default "
                                   "0: none)")
    scratch_cap_mib: int = _setting(0, "most MiB of restore scratch (partial copies of old "
                                    "ranks' shards fetched after a change of world size) one "
                                    "job may hold on this node (default 0: half of its RAM)")
    persist_dir: str = _setting("", "persistent checkpoint tier (shared filesystem); empty: "
                                "none")
    persist_every_steps: int = _setting(0, "flush a complete step to the persistent tier every "
                                        "N steps (default 0: not by steps)")
    persist_every_seconds: float = _setting(0.0, "flush a complete step to the persistent tier "
                                            "every N seconds (default 0: not by time)")
    persist_keep: int = _setting(3, "complete steps kept on the persistent tier per job "
                                 "(default 3)")
    cluster_secret: str = _setting("", "shared secret authenticating replication, at least 128 "
                                   "bits counted from its alphabet (32 hex digits, 22 base64 "
                                   "characters); no flag: ELASTICD_CLUSTER_SECRET or the file")
    cluster_secret_file: str = _setting("", "file with the replication secret, first line (or "
                                        "env ELASTICD_CLUSTER_SECRET); without a secret, peer "
                                        "replication is off")
    replication_listen: str = _setting("0.0.0.0:9401", "HOST:PORT of the replication server "
                                       "(default 0.0.0.0:9401; port 0: any)")
    replicas: int = _setting(2, "copies of each snapshot, its own included (default 2; 1 turns "
                             "peers off)")
    unprotected_lag_steps: int = _setting(100, "commit lag in steps past which a job shows "
                                          "UNPROTECTED; also the slack, beside 3 flush "
                                          "periods, of a stale persistent tier (default 100)")
    log_level: str = _setting("INFO", "DEBUG, INFO, WARNING or ERROR (default INFO)")
    job_users: str = _setting("", "users jobs may run as here, comma-separated (default: any "
                              "but root; *: any, root too)")
    job_python: str = _setting("", "the only interpreter a job may name (default: the "
                               "daemon's own)")
    job_env_allow: str = _setting("", "variables a job may set although refused by default "
                                  "(LD_*, PYTHON*, BASH_ENV, ENV): names or patterns, "
                                  "comma-separated")
    agent_etcd_users: str = _setting("auto", "auto (default: on when the daemon authenticates "
                                     "to etcd), on or off: an etcd user per job for its "
                                     "agents, allowed only its rendezvous; off: agents get no "
                                     "etcd credentials")
    agent_etcd_cert: str = _setting("", "client certificate for agents, when etcd asks for one "
                                    "(with --agent-etcd-key); its common name must not be an "
                                    "etcd user with permissions (the job's user can read it)")
    agent_etcd_key: str = _setting("", "client key for agents")

    # -- derived --------------------------------------------------------------------------

    @property
    def listen_addr(self) -> tuple[str, int]:
        return _hostport(self.listen)

    @property
    def provisional_seconds(self) -> float:
        return self.provisional_grace or 2.0 * self.lease_ttl + 2.0

    @property
    def scratch_cap_bytes(self) -> int:
        """One job's restore scratch cap on this node, in bytes (``scratch_cap_mib``)."""
        if self.scratch_cap_mib:
            return self.scratch_cap_mib * 2**20
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2

    @property
    def state_path(self) -> str:
        if self.state_dir:
            return self.state_dir
        base = "/var/lib/elasticd" if os.geteuid() == 0 else os.path.expanduser(
            "~/.local/state/elasticd")
        return os.path.join(base, self.node_id)

    @property
    def secret(self) -> bytes:
        """The cluster secret (from the setting or its file); empty when replication is off."""
        if self.cluster_secret:
            return self.cluster_secret.encode()
        if self.cluster_secret_file:
            return read_secret_file(self.cluster_secret_file)
        return b""

    @property
    def replication_addr(self) -> tuple[str, int]:
        return _hostport(self.replication_listen)

    @property
    def shm_path(self) -> str:
        return self.shm_dir or f"/dev/shm/elasticd-{self.node_id}"

    def etcd_settings(self) -> EtcdSettings:
        return EtcdSettings.of(parse_endpoints(self.etcd), self)

    def job_policy(self) -> "JobPolicy":
        from elasticd.cluster.job_policy import JobPolicy, split_list

        return JobPolicy(users=split_list(self.job_users),
                         python=self.job_python or sys.executable,
                         env_allow=split_list(self.job_env_allow))

    @property
    def agent_users_on(self) -> bool:
        if self.agent_etcd_users == "auto":
            return bool(self.etcd and (self.etcd_user or self.etcd_cert))
        return self.agent_etcd_users == "on"


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}

#: Numeric settings' ranges: (lowest, highest or None for no bound, unit and what 0 means).
_RANGES: dict[str, tuple[float, float | None, str]] = {
    "lease_ttl": (2, 300, " seconds"),
    "loop_interval": (0.05, 60, " seconds"),
    "heartbeat_interval": (0, None, " (0: no timed rewrite, the lease carries liveness)"),
    "outage_grace": (0, None, " seconds"),
    "provisional_grace": (0, None, " seconds (0 means: 2 x lease_ttl + 2)"),
    "events_retention": (10, 100_000, ""),
    "agent_restarts": (0, 1000, ""),
    "stop_grace": (0, 600, " seconds"),
    "memory_cap_mib": (0, None, " (0: no cap)"),
    "scratch_cap_mib": (0, None, " (0: half of this node's RAM)"),
    "persist_every_steps": (0, None, ""),
    "persist_every_seconds": (0, None, ""),
    "persist_keep": (1, 1000, ""),
    "replicas": (1, 8, " copies (2 is the usual)"),
    "unprotected_lag_steps": (1, 10_000_000, " steps"),
}


def _coerce(name: str, value: Any, source: str) -> Any:
    ftype = _FIELDS[name].type
    try:
        if ftype == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if ftype == "float":
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
        else:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        kind = {"int": "a whole number", "float": "a number"}.get(ftype, "a string")
        raise ConfigError(f"{name} (from {source}): {value!r} is not {kind}") from None
    if not math.isfinite(number):
        # nan passes every range check (each comparison is False) and inf makes timers that
        # never fire: refused here, for flags, environment and file alike.
        raise ConfigError(f"{name} (from {source}): {value!r} is not a finite number: give "
                          f"seconds, e.g. {_FIELDS[name].default:g} (the default)")
    return number


def _validate(s: Settings, sources: Mapping[str, str]) -> None:
    def bad(name: str, why: str) -> ConfigError:
        return ConfigError(f"{name} (from {sources.get(name, 'default')}): {why}")

    def parses(name: str, parse: Callable[[str], Any], hint: str = "") -> None:
        try:
            parse(getattr(s, name))
        except ValueError as exc:
            raise bad(name, f"{exc}{hint}") from None

    parses("node_id", lambda v: check_name("node_id", v))
    parses("prefix", check_prefix)
    if s.etcd:
        parses("etcd", parse_endpoints, "; expected HOST:PORT[,HOST:PORT...]")
    parses("listen", _hostport)
    for name, (low, high, unit) in _RANGES.items():
        value = getattr(s, name)
        if value < low or (high is not None and value > high):
            use = f"{low} to {high}" if high is not None else f">= {low}"
            raise bad(name, f"{value} is out of range: use {use}{unit}")
    if not 0.1 <= s.etcd_timeout <= s.lease_ttl:
        raise bad("etcd_timeout", f"{s.etcd_timeout} must be between 0.1 s and lease_ttl "
                  f"({s.lease_ttl} s), or a slow request would cost the lease")
    for name, choices in (("worker_start", ("warm", "cold")),
                          ("agent_etcd_users", ("auto", "on", "off")),
                          ("log_level", ("DEBUG", "INFO", "WARNING", "ERROR"))):
        value = getattr(s, name)
        if (value.upper() if name == "log_level" else value) not in choices:
            raise bad(name, f"{value!r}: use {', '.join(choices[:-1])} or {choices[-1]}")
    if bool(s.etcd_user) != bool(s.etcd_password):
        raise bad("etcd_user", "etcd_user and etcd_password must be given together")
    for cert, key in (("etcd_cert", "etcd_key"), ("agent_etcd_cert", "agent_etcd_key")):
        if bool(getattr(s, cert)) != bool(getattr(s, key)):
            raise bad(cert, f"{cert} and {key} must be given together")
    if s.etcd_cert and not s.etcd_ca_cert:
        raise bad("etcd_ca_cert", "a client certificate needs etcd_ca_cert too")
    for name in ("etcd_ca_cert", "etcd_cert", "etcd_key", "agent_etcd_cert", "agent_etcd_key"):
        path = getattr(s, name)
        if path and not os.path.isfile(path):
            raise bad(name, f"file {path!r} does not exist")
    if not 0 < s.rdzv_last_call <= 600:
        raise bad("rdzv_last_call", f"{s.rdzv_last_call}: use more than 0 and at most 600 s")
    parses("rdzv_grow", check_grow)
    if s.persist_dir and not os.path.isdir(s.persist_dir):
        raise bad("persist_dir", f"{s.persist_dir!r} is not a directory: create it (on a "
                  "filesystem every node mounts) or leave persist_dir empty")
    try:
        secret = s.secret
    except SecretFileError as exc:
        raise bad("cluster_secret_file", str(exc)) from None
    # A passive observer of a handshake can test guesses offline (docs/security.md): only
    # the secret's entropy, counted from its alphabet, stands in the way.
    weak = weak_secret(secret) if secret else ""
    if weak:
        raise bad("cluster_secret" if s.cluster_secret else "cluster_secret_file", weak)
    parses("replication_listen", _hostport)
    _validate_job_policy(s, bad)


def _validate_job_policy(s: Settings, bad: Any) -> None:
    from elasticd.cluster.job_policy import split_list

    for user in [u for u in split_list(s.job_users) if u != "*"]:
        try:
            pwd.getpwnam(user)
        except (KeyError, ValueError):
            raise bad("job_users", f"{user!r}: no such user on this machine") from None
    if s.job_python and (not os.path.isabs(s.job_python)
                         or not os.access(s.job_python, os.X_OK)):
        raise bad("job_python", f"{s.job_python!r} is not an absolute path to an executable "
                  "(the python that has torch and elasticd)")
    for pattern in split_list(s.job_env_allow):
        if not all(c.isalnum() or c in "_*?" for c in pattern):
            raise bad("job_env_allow", f"{pattern!r}: expected NAME or a pattern like LD_*")
    if s.agent_etcd_users == "on" and not s.etcd:
        raise bad("agent_etcd_users", "on needs an external etcd (--etcd) whose users the "
                  "daemon may manage")


def load(
    cli: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Builds validated settings from a TOML file, the environment and CLI values.

    Args:
        cli: values given on the command line (None values are ignored).
        config_file: path of a TOML file with top-level keys named like the settings
            (``node_id = "n1"``) or under an ``[elasticd]`` table.
        environ: the environment (``ELASTICD_NODE_ID=n1``); ``os.environ`` by default.

    Raises:
        ConfigError: naming the first bad setting.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG") or None
    if config_file:
        try:
            with open(config_file, "rb") as fh:
                doc = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config: file {config_file!r} does not exist") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config: {config_file!r} is not valid TOML: {exc}") from None
        table = doc.get("elasticd", doc)
        if not isinstance(table, dict):
            raise ConfigError(f"config: [elasticd] in {config_file!r} must be a table")
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in _FIELDS:
                raise ConfigError(f"{key} (from {config_file}): unknown setting; known: "
                                  + ", ".join(sorted(_FIELDS)))
            values[name] = _coerce(name, value, config_file)
            sources[name] = config_file

    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_PREFIX + "CONFIG":
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in _FIELDS:
            raise ConfigError(f"{key} (from environment): unknown setting; known: "
                              + ", ".join(ENV_PREFIX + n.upper() for n in sorted(_FIELDS)))
        values[name] = _coerce(name, raw, f"environment {key}")
        sources[name] = f"environment {key}"

    for name, value in (cli or {}).items():
        if value is not None:
            sources[name] = "--" + name.replace("_", "-")
            values[name] = _coerce(name, value, sources[name])

    settings = Settings(**values)
    _validate(settings, sources)
    return settings
