"""etcd credentials of a job's torchrun agent: its own user, allowed only its job's rendezvous.

The daemon's etcd user may write the whole cluster prefix (every node record, every job spec):
handing it to an agent, which runs as the job's unprivileged user (and whose workers run the
job's code), would give that user the cluster, and whoever may write a job's rendezvous prefix
can disturb that job's rounds (no longer run code: the rendezvous reads JSON, not pickle). So
each agent gets credentials of its own, limited to its job:
per (job, node) the user ``elasticd-agent.<tag>.<job>@<node>`` (``@`` is in no name: the
``.`` before issue 26 let two pairs share a user; a daemon deletes its own users of that scheme,
:func:`old_users_of`), and the roles ``elasticd-rdzv.<tag>.<job>`` (read-write on the job's
``rdzv/`` only) and ``elasticd-node.<tag>.<node>`` (read on the node's record only, for
:mod:`elasticd.agent.daemon_watch`); ``<tag>`` hashes the cluster prefix. How the password and
the TLS files reach the agent: docs/operations.md, "The agents' credentials".
"""

from __future__ import annotations

import hashlib
import logging
import os
import pwd
import secrets
import shutil
from typing import Any, Iterable

from elasticd.coordination.api import CoordinationError, prefix_range_end
from elasticd.coordination.keys import NAME_RE, Keyspace

log = logging.getLogger(__name__)

#: Variable holding the agent's etcd password (the rendezvous reads it).
PASSWORD_ENV = "ELASTICD_ETCD_PASSWORD"
#: Between the job and the node in an agent's user name: a character no name may contain
#: (:data:`~elasticd.coordination.keys.NAME_RE`).
USER_SEPARATOR = "@"


def old_users_of(users: Iterable[str], tag: str, node: str, live: Iterable[str]) -> list[str]:
    """The users among ``users`` that ``node`` made for its agents under the old scheme,
    ``elasticd-agent.<tag>.<job>.<node>``: not one that another live node could have made
    (``elasticd-agent.<tag>.a.b.c`` is job ``a.b`` on node ``c`` or job ``a`` on ``b.c``)."""
    head = f"elasticd-agent.{tag}."
    others = [n for n in live if n != node]

    def could_be(rest: str, who: str) -> bool:
        return rest.endswith("." + who) and bool(NAME_RE.fullmatch(rest[: -len(who) - 1]))

    return [user for user in users
            if user.startswith(head) and USER_SEPARATOR not in user
            and could_be(user[len(head):], node)
            and not any(could_be(user[len(head):], other) for other in others)]


class AgentCredentials:
    """Issues and withdraws the etcd credentials of this node's agents.

    Args:
        coord: the daemon's etcd connection (an :class:`EtcdCoordinator` whose user has
            etcd's root role).
        files_dir: a root-owned directory for the TLS files handed to agents.
        ca_cert: the CA that signed etcd's server certificate ("" for plaintext etcd).
        agent_cert, agent_key: a client certificate for agents ("" when etcd asks for none).
        users: create per-job etcd users (False: TLS files only, for an etcd without auth).
    """

    def __init__(self, coord: Any, keys: Keyspace, node_id: str, files_dir: str,
                 ca_cert: str = "", agent_cert: str = "", agent_key: str = "",
                 users: bool = True) -> None:
        self.coord, self.keys, self.node_id = coord, keys, node_id
        self.files_dir = files_dir
        self.ca_cert, self.agent_cert, self.agent_key = ca_cert, agent_cert, agent_key
        self.users = users
        self.tag = hashlib.sha256(keys.prefix.encode()).hexdigest()[:8]
        self._retired = False  # users under the old names looked for (retire_old_users)
        # user -> the password an issue set before it failed (etcd refusing it while users
        # change, past what the daemon waits): its retry keeps it, since setting another is
        # one more change of etcd's auth store, which makes etcd refuse more requests.
        self._unfinished: dict[str, str] = {}

    def user_name(self, job: str) -> str:
        return f"elasticd-agent.{self.tag}.{job}{USER_SEPARATOR}{self.node_id}"

    def job_role(self, job: str) -> str:
        return f"elasticd-rdzv.{self.tag}.{job}"

    def node_role(self) -> str:
        return f"elasticd-node.{self.tag}.{self.node_id}"

    def issue(self, spec: Any) -> tuple[dict[str, str], dict[str, str]]:
        """Creates (or renews) this node's credentials for ``spec``'s agent.

        Returns:
            (extra ``--rdzv-conf`` entries, extra environment) for the agent.

        Raises:
            CoordinationError: etcd refused (e.g. the daemon's user lacks the root role).
            OSError: the TLS files could not be written.
        """
        conf = self._files(spec.name, spec.user) if self.ca_cert or self.agent_cert else {}
        env: dict[str, str] = {}
        if self.users:
            user = self.user_name(spec.name)
            self._ensure_role(self.job_role(spec.name), self.keys.rendezvous(spec.name).prefix,
                              prefix=True, write=True)
            self._ensure_role(self.node_role(), self.keys.node(self.node_id),
                              prefix=False, write=False)
            password, has = self._unfinished_user(user) or self._new_user(user)
            for role in (self.job_role(spec.name), self.node_role()):
                if role not in has:
                    self._auth("UserGrantRole", "AuthUserGrantRoleRequest", user=user, role=role)
            self._unfinished.pop(user, None)
            conf["user"] = user
            env[PASSWORD_ENV] = password
            if not self._retired:
                self.retire_old_users()
        return conf, env

    def withdraw(self, job: str) -> None:
        """Deletes this node's etcd user for ``job`` and its TLS files (the job ended here)."""
        shutil.rmtree(os.path.join(self.files_dir, job), ignore_errors=True)
        self._unfinished.pop(self.user_name(job), None)
        if not self.users:
            return
        self._delete_user(self.user_name(job), job)
        self.retire_old_users()

    def retire_old_users(self) -> None:
        """Deletes this node's agent users named under the scheme before issue 26 (see the
        module docstring): a restarted daemon has no agent that could still use one, and a
        job that ended while it was down left its user behind. A name that may as well be
        another live node's is left alone (that node may still run an older daemon); it goes
        when that node's job ends there. Failures are logged, never raised."""
        try:
            listed = self._auth("UserList", "AuthUserListRequest")
            nodes, _ = self.coord.get_prefix(self.keys.nodes)
            others = {kv.key[len(self.keys.nodes):].decode(errors="replace") for kv in nodes}
        except CoordinationError as exc:
            log.warning("could not look for agent etcd users under the old names: %s", exc)
            return
        self._retired = True
        for user in old_users_of(listed.users, self.tag, self.node_id, others):
            log.info("deleting agent etcd user %s (named before issue 26, when names collided)",
                     user)
            self._delete_user(user, user)

    def _delete_user(self, user: str, what: str) -> None:
        try:
            self._auth("UserDelete", "AuthUserDeleteRequest", name=user)
        except CoordinationError as exc:
            if "not found" not in str(exc):
                log.warning("could not delete the etcd user of %s's agent: %s", what, exc)

    # -- etcd users and roles -----------------------------------------------------------------

    def _auth(self, method: str, request: str, **fields: Any) -> Any:
        from pyetcd import etcdrpc

        return self.coord.auth_call(method, getattr(etcdrpc, request)(**fields))

    # Each change of etcd's users or roles moves its auth store's revision, and while it moves
    # etcd refuses writes that race a change and repeats every log-in (each a bcrypt check):
    # at a job's start on N nodes at once that cost N² log-in checks (bench/scale_credentials.py).
    # So nothing is changed that already holds: a role and its permission are read first (every
    # node of a job would otherwise re-grant the same one), a user's roles too.

    def _new_user(self, user: str) -> tuple[str, set[str]]:
        """Sets a new password for ``user`` (creating it); returns it and the user's roles."""
        password = secrets.token_urlsafe(24)
        has = self._ensure_user(user, password)
        self._unfinished[user] = password
        return password, has

    def _unfinished_user(self, user: str) -> tuple[str, set[str]] | None:
        """The password and roles of ``user`` as an issue that failed after setting them left
        it, or None (none did, or the user is gone since)."""
        password = self._unfinished.get(user)
        if password is None:
            return None
        try:
            return password, set(self._auth("UserGet", "AuthUserGetRequest", name=user).roles)
        except CoordinationError as exc:
            if "not found" not in str(exc):
                raise
            del self._unfinished[user]
            return None

    def _ensure_user(self, user: str, password: str) -> set[str]:
        """Creates ``user`` with ``password`` (or sets the password of the one there); returns
        the roles it already has."""
        try:
            self._auth("UserAdd", "AuthUserAddRequest", name=user, password=password)
            return set()
        except CoordinationError as exc:
            if "already exists" not in str(exc):
                raise
        self._auth("UserChangePassword", "AuthUserChangePasswordRequest", name=user,
                   password=password)
        return set(self._auth("UserGet", "AuthUserGetRequest", name=user).roles)

    def _ensure_role(self, role: str, key: bytes, prefix: bool, write: bool) -> None:
        from pyetcd.etcdrpc import auth_pb2

        perm = auth_pb2.Permission(
            permType=auth_pb2.Permission.READWRITE if write else auth_pb2.Permission.READ,
            key=key, range_end=prefix_range_end(key) if prefix else b"")
        try:
            held = self._auth("RoleGet", "AuthRoleGetRequest", role=role).perm
        except CoordinationError as exc:
            if "not found" not in str(exc):
                raise
            try:
                self._auth("RoleAdd", "AuthRoleAddRequest", name=role)
            except CoordinationError as exc2:  # another node of the job made it meanwhile
                if "already exists" not in str(exc2):
                    raise
            held = []
        if any(p == perm for p in held):
            return
        self._auth("RoleGrantPermission", "AuthRoleGrantPermissionRequest", name=role,
                   perm=perm)

    # -- TLS files ------------------------------------------------------------------------------

    def _files(self, job: str, user: str) -> dict[str, str]:
        """Copies the agent's TLS files, each readable by the job's user only, into a fresh
        root-owned directory (no one else can have planted anything there)."""
        pw = pwd.getpwnam(user)
        os.makedirs(self.files_dir, mode=0o711, exist_ok=True)
        d = os.path.join(self.files_dir, job)
        shutil.rmtree(d, ignore_errors=True)
        os.mkdir(d, 0o711)
        out = {}
        for name, src in (("ca_cert", self.ca_cert), ("cert", self.agent_cert),
                          ("key", self.agent_key)):
            if not src:
                continue
            with open(src, "rb") as fh:
                data = fh.read()
            path = os.path.join(d, name + ".pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
            try:
                os.write(fd, data)
                if os.geteuid() == 0:
                    os.fchown(fd, pw.pw_uid, pw.pw_gid)
            finally:
                os.close(fd)
            out[name] = path
        return out
