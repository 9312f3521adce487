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
from elasticd.rendezvous.rounds import GROW_POLICIES, check_grow
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


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything an ``elasticd`` process is told.

    Attributes:
        node_id: this node's name in the cluster (default: the host name).
        etcd: ``HOST:PORT[,HOST:PORT...]`` of the etcd cluster; empty starts a private etcd.
        prefix: etcd key prefix of the cluster; daemons with the same prefix form one cluster.
        listen: ``HOST:PORT`` of the HTTP endpoint (/metrics, /healthz, /status).
        lease_ttl: seconds without a keep-alive after which etcd declares this node dead.
        loop_interval: seconds between main-loop cycles when nothing happens.
        heartbeat_interval: seconds between rewrites of the node record on a timer; 0 (the
            default): none, the record is written on a state change only and the lease (kept
            alive every TTL/3) carries liveness. A positive value keeps ``heartbeat_at`` fresh
            for tools that read the record's age, at N/interval etcd writes per second.
        etcd_timeout: seconds one etcd request may take.
        outage_grace: seconds the node keeps its workers running while etcd is unreachable.
        provisional_grace: seconds a peer's lease expiry, seen while this node was itself cut
            off from etcd, stays provisional before it is recorded as a failure (0: 2 TTL + 2).
        events_retention: number of cluster events kept in etcd.
        etcd_user, etcd_password, etcd_ca_cert, etcd_cert, etcd_key: etcd auth and TLS.
        state_dir: where job logs and the daemon's local socket live.
        agent_restarts: how often the daemon restarts a job's agent that died, with backoff,
            in a row (a newer committed step of the job renews the count).
        stop_grace: seconds between SIGTERM and SIGKILL when stopping a job's processes.
        rdzv_last_call: torchrun's last_call_timeout (seconds a complete round waits for more).
        rdzv_grow: when a node that returns or is added enters a running job: "immediate"
            (every node stops once to let it in), "at-failure" (it waits as a spare and
            enters at the next failure, with no extra stop) or "interval:MIN" (as at-failure,
            and at most once every MIN minutes, at a committed step, it enters at once); the
            rendezvous' ``grow`` key.
        worker_start: "warm" (a per-job zygote that imported torch forks each worker:
            elasticd/agent/zygote.py) or "cold" (torchrun starts a new interpreter per worker).
        shm_dir: directory (tmpfs) of the daemon-owned checkpoint slots (default
            /dev/shm/elasticd-<node_id>).
        memory_cap_mib: cap on checkpoint RAM (local snapshots and peer replicas) on this node;
            a snapshot over it is skipped with a warning (0: no cap).
        scratch_cap_mib: cap on one job's restore scratch on this node (partial copies of old
            ranks' shards fetched after a change of world size, elasticd/store/scratch.py);
            a fetch over it is refused (0, the default: half of this node's RAM).
        persist_dir: the persistent tier (a shared filesystem); empty: none.
        persist_every_steps, persist_every_seconds: how often a complete step is flushed.
        persist_keep: complete steps kept on the persistent tier per job.
        cluster_secret: shared secret authenticating daemon-to-daemon replication (at least
            128 bits counted from its alphabet: 32 hex digits, 22 base64 characters; prefer
            ELASTICD_CLUSTER_SECRET or cluster_secret_file). Without a secret, peer
            replication is off.
        cluster_secret_file: file holding the secret (first line).
        replication_listen: HOST:PORT of the replication server (port 0: any free port).
        replicas: copies of each rank's snapshot, its own included (m; 1 turns peers off).
        unprotected_lag_steps: a job whose committed step lags its newest snapshot by more
            steps than this shows as UNPROTECTED (commit_lag); also the slack, beside 3 flush
            periods, of a persistent tier that gets no new complete step (persist_stale).
        log_level: DEBUG, INFO, WARNING or ERROR.
        job_users: users jobs may run as on this node, comma-separated (empty: any user but
            root; ``*``: any user, root too); part of the node's job policy
            (elasticd/cluster/job_policy.py).
        job_python: the only interpreter a job may name (empty: the daemon's own).
        job_env_allow: environment variables (names or ``fnmatch`` patterns, comma-separated)
            a job may set although they are refused by default (``LD_*``, ``PYTHON*``,
            ``BASH_ENV``, ``ENV``).
        agent_etcd_users: ``auto`` (on when the daemon authenticates to etcd) or ``on``: each
            node creates, per job, an etcd user of its own whose role may write only the job's
            rendezvous prefix, and hands it to the job's agent; ``off``: agents get no etcd
            credentials (an etcd without authentication).
        agent_etcd_cert, agent_etcd_key: a TLS client certificate for agents, when etcd asks
            clients for one; its common name must not be an etcd user with permissions (the
            job's user can read it).
    """

    node_id: str = dataclasses.field(default_factory=lambda: socket.gethostname().split(".")[0])
    etcd: str = ""
    prefix: str = "/elasticd"
    listen: str = "127.0.0.1:9400"
    lease_ttl: int = 5
    loop_interval: float = 1.0
    heartbeat_interval: float = 0.0
    etcd_timeout: float = 1.0
    outage_grace: float = 30.0
    provisional_grace: float = 0.0
    events_retention: int = 1000
    etcd_user: str = ""
    etcd_password: str = ""
    etcd_ca_cert: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    state_dir: str = ""
    agent_restarts: int = 10
    stop_grace: float = 10.0
    rdzv_last_call: float = 1.0
    rdzv_grow: str = "immediate"
    worker_start: str = "warm"
    shm_dir: str = ""
    memory_cap_mib: int = 0
    scratch_cap_mib: int = 0
    persist_dir: str = ""
    persist_every_steps: int = 0
    persist_every_seconds: float = 0.0
    persist_keep: int = 3
    cluster_secret: str = ""
    cluster_secret_file: str = ""
    replication_listen: str = "0.0.0.0:9401"
    replicas: int = 2
    unprotected_lag_steps: int = 100
    log_level: str = "INFO"
    job_users: str = ""
    job_python: str = ""
    job_env_allow: str = ""
    agent_etcd_users: str = "auto"
    agent_etcd_cert: str = ""
    agent_etcd_key: str = ""

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
        return EtcdSettings(
            endpoints=parse_endpoints(self.etcd),
            timeout=self.etcd_timeout,
            user=self.etcd_user or None,
            password=self.etcd_password or None,
            ca_cert=self.etcd_ca_cert or None,
            cert=self.etcd_cert or None,
            key=self.etcd_key or None,
        )

    def job_policy(self) -> "JobPolicy":
        """The node's job policy from ``job_users``, ``job_python`` and ``job_env_allow``."""
        from elasticd.cluster.job_policy import JobPolicy, split_list

        return JobPolicy(users=split_list(self.job_users),
                         python=self.job_python or sys.executable,
                         env_allow=split_list(self.job_env_allow))

    @property
    def agent_users_on(self) -> bool:
        """Whether agents get per-job etcd users (``agent_etcd_users``)."""
        if self.agent_etcd_users == "auto":
            return bool(self.etcd and (self.etcd_user or self.etcd_cert))
        return self.agent_etcd_users == "on"


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


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
    if not 2 <= s.lease_ttl <= 300:
        raise bad("lease_ttl", f"{s.lease_ttl} is out of range: use 2 to 300 seconds")
    if not 0.05 <= s.loop_interval <= 60:
        raise bad("loop_interval", f"{s.loop_interval} is out of range: use 0.05 to 60 seconds")
    if s.heartbeat_interval < 0:
        raise bad("heartbeat_interval", "must be >= 0 (0: no timed rewrite, the lease "
                  "carries liveness)")
    if not 0.1 <= s.etcd_timeout <= s.lease_ttl:
        raise bad("etcd_timeout", f"{s.etcd_timeout} must be between 0.1 s and lease_ttl "
                  f"({s.lease_ttl} s), or a slow request would cost the lease")
    if s.outage_grace < 0:
        raise bad("outage_grace", "must be >= 0 seconds")
    if s.provisional_grace < 0:
        raise bad("provisional_grace", "must be >= 0 seconds (0 means: 2 x lease_ttl + 2)")
    if not 10 <= s.events_retention <= 100_000:
        raise bad("events_retention", f"{s.events_retention} is out of range: use 10 to 100000")
    if bool(s.etcd_user) != bool(s.etcd_password):
        raise bad("etcd_user", "etcd_user and etcd_password must be given together")
    if bool(s.etcd_cert) != bool(s.etcd_key):
        raise bad("etcd_cert", "etcd_cert and etcd_key must be given together")
    if s.etcd_cert and not s.etcd_ca_cert:
        raise bad("etcd_ca_cert", "a client certificate needs etcd_ca_cert too")
    for name in ("etcd_ca_cert", "etcd_cert", "etcd_key"):
        path = getattr(s, name)
        if path and not os.path.isfile(path):
            raise bad(name, f"file {path!r} does not exist")
    if not 0 <= s.agent_restarts <= 1000:
        raise bad("agent_restarts", f"{s.agent_restarts} is out of range: use 0 to 1000")
    if not 0 <= s.stop_grace <= 600:
        raise bad("stop_grace", f"{s.stop_grace} is out of range: use 0 to 600 seconds")
    if s.worker_start not in ("warm", "cold"):
        raise bad("worker_start", f"{s.worker_start!r}: use warm or cold")
    if not 0 < s.rdzv_last_call <= 600:
        raise bad("rdzv_last_call", f"{s.rdzv_last_call}: use more than 0 and at most 600 s")
    parses("rdzv_grow", check_grow)
    if s.memory_cap_mib < 0:
        raise bad("memory_cap_mib", "must be >= 0 (0: no cap)")
    if s.scratch_cap_mib < 0:
        raise bad("scratch_cap_mib", "must be >= 0 (0: half of this node's RAM)")
    if s.persist_every_steps < 0 or s.persist_every_seconds < 0:
        raise bad("persist_every_steps", "persist_every_steps/seconds must be >= 0")
    if not 1 <= s.persist_keep <= 1000:
        raise bad("persist_keep", f"{s.persist_keep}: use 1 to 1000")
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
    if not 1 <= s.replicas <= 8:
        raise bad("replicas", f"{s.replicas}: use 1 to 8 copies (2 is the usual)")
    if not 1 <= s.unprotected_lag_steps <= 10_000_000:
        raise bad("unprotected_lag_steps", f"{s.unprotected_lag_steps}: use 1 to 10000000 steps")
    if s.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise bad("log_level", f"{s.log_level!r}: use DEBUG, INFO, WARNING or ERROR")
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
    if s.agent_etcd_users not in ("auto", "on", "off"):
        raise bad("agent_etcd_users", f"{s.agent_etcd_users!r}: use auto, on or off")
    if s.agent_etcd_users == "on" and not s.etcd:
        raise bad("agent_etcd_users", "on needs an external etcd (--etcd) whose users the "
                  "daemon may manage")
    if bool(s.agent_etcd_cert) != bool(s.agent_etcd_key):
        raise bad("agent_etcd_cert", "agent_etcd_cert and agent_etcd_key must be given together")
    for name in ("agent_etcd_cert", "agent_etcd_key"):
        path = getattr(s, name)
        if path and not os.path.isfile(path):
            raise bad(name, f"file {path!r} does not exist")


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
