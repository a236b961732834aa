"""Who else can write what the node runs: the model directory (config.json, the shards, and the
model's own Python, which vLLM runs with trust_remote_code), the cluster file, and the runtime
(vLLM's command, its Python, site-packages and the vllm package). Whoever can write one of them,
or replace it through a directory above it, changes what the node serves or runs code as the
service user: a warn, with the chmod that closes it.

"Others" are the users other than root and the service user. A path is writable by others when
its mode has o+w, or g+w with a group that has a member other than root, the service user and
the path's owner (the group's members in the group database, and every user whose primary
group it is). A directory above a path lets others replace the path when others can write the
directory, unless it is sticky (o+t, like /tmp) and both it and the path belong to root or the
service user. Who owns a path is the operator's choice and not judged; ACLs are not read.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from dspark.config.schema import Cluster
from dspark.preflight.result import Check, ok, warn
from dspark.units.user import ServiceUser

MAX_ENTRIES = 50_000  # a model directory or the vllm package: a few thousand entries
SHOWN = 3


@dataclass(frozen=True)
class Finding:
    path: Path
    seen: str  # what lets others write it, in words
    fix: str


@dataclass
class Trust:
    """Root and the service user; the group database read once."""

    user: ServiceUser
    _members: dict[int, frozenset[int]] = field(default_factory=dict)
    _primary: dict[int, set[int]] | None = None

    @property
    def uids(self) -> frozenset[int]:
        return frozenset({0, self.user.uid})

    def members(self, gid: int) -> frozenset[int]:
        if gid not in self._members:
            if self._primary is None:
                self._primary = {}
                for pw in pwd.getpwall():
                    self._primary.setdefault(pw.pw_gid, set()).add(pw.pw_uid)
            uids = set(self._primary.get(gid, ()))
            try:
                for name in grp.getgrgid(gid).gr_mem:
                    try:
                        uids.add(pwd.getpwnam(name).pw_uid)
                    except KeyError:
                        continue
            except KeyError:
                pass
            self._members[gid] = frozenset(uids)
        return self._members[gid]

    def writers(self, st: os.stat_result) -> tuple[str, str] | None:
        """(why others can write it, the chmod that stops it), or None."""
        if stat.S_ISLNK(st.st_mode):
            return None  # a link's own mode means nothing; its target and its directory are looked at
        if st.st_mode & stat.S_IWOTH:
            return "world-writable", "o-w"
        if st.st_mode & stat.S_IWGRP:
            others = self.members(st.st_gid) - self.uids - {st.st_uid}
            if others:
                names = ", ".join(sorted(_user(u) for u in others)[:3]) + (", ..." if len(others) > 3 else "")
                return f"group-writable by {_group(st.st_gid)} ({names})", "g-w"
        return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


class Scan:
    """Findings for a set of paths, each looked at once with every directory above it."""

    def __init__(self, trust: Trust):
        self.trust = trust
        self.findings: list[Finding] = []
        self._seen: set[Path] = set()     # paths looked at
        self._flagged: set[Path] = set()  # paths found writable by others (said once)
        self.entries = 0

    def path(self, p: Path) -> None:
        """`p` itself (a file, or a directory others could add to) and the directories above it,
        along the path as written and along the path its links resolve to."""
        p = Path(os.path.abspath(p))
        st = self._first_stat(p)
        if st is not None:
            self._above(p, st)
            self._itself(p, st)

    def tree(self, root: Path) -> None:
        """`root` and everything under it (bounded), links not followed."""
        self.path(root)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                self.entries += 1
                if self.entries > MAX_ENTRIES:
                    return
                self._entry(Path(dirpath) / name)

    def children(self, root: Path) -> None:
        """`root` and its entries, not below them."""
        self.path(root)
        try:
            names = sorted(os.listdir(root))
        except OSError:
            return
        for name in names[:MAX_ENTRIES]:
            self._entry(root / name)

    def _entry(self, p: Path) -> None:
        """An entry whose directory is already looked at: only itself."""
        st = self._first_stat(p)
        if st is not None:
            self._itself(p, st)

    def _first_stat(self, p: Path) -> os.stat_result | None:
        """`p`'s own stat (links not followed) the first time it is looked at; None after that,
        or when it cannot be read."""
        if p in self._seen:
            return None
        self._seen.add(p)
        try:
            return os.lstat(p)
        except OSError:
            return None

    def _itself(self, p: Path, st: os.stat_result) -> None:
        if stat.S_ISLNK(st.st_mode):  # e.g. the Hugging Face cache's snapshot -> blob links
            self.path(Path(os.path.realpath(p)))
            return
        w = self.trust.writers(st)
        if w and p not in self._flagged:
            self._flagged.add(p)
            self.findings.append(Finding(p, f"{p} ({stat.filemode(st.st_mode)}, {w[0]})", f"chmod {w[1]} {p}"))

    def _above(self, p: Path, st: os.stat_result) -> None:
        """Each directory above `p` that lets others replace what it holds on the way to `p`."""
        child, child_st = p, st
        for d in p.parents:
            try:
                dst = os.stat(d)
            except OSError:
                return
            w = self.trust.writers(dst) if d not in self._flagged else None
            sticky_ours = (dst.st_mode & stat.S_ISVTX and dst.st_uid in self.trust.uids
                           and child_st.st_uid in self.trust.uids)
            if w and not sticky_ours:
                self._flagged.add(d)
                fix = f"move {child} out of {d}" if dst.st_mode & stat.S_ISVTX else f"chmod {w[1]} {d}"
                self.findings.append(Finding(d, f"{d} ({stat.filemode(dst.st_mode)}, {w[0]}) lets others "
                                                f"replace {child}", fix))
            child, child_st = d, dst

    def take(self) -> list[Finding]:
        """The findings so far; the next ones (another area's) are said afresh."""
        out, self.findings = self.findings, []
        self._seen.clear()
        self._flagged.clear()
        return out


def _report(name: str, what: str, findings: list[Finding], why: str) -> Check:
    shown = "; ".join(f.seen for f in findings[:SHOWN])
    more = f" and {len(findings) - SHOWN} more" if len(findings) > SHOWN else ""
    fixes = list(dict.fromkeys(f.fix for f in findings))
    fix = "; ".join(fixes[:SHOWN]) + (f" (and {len(fixes) - SHOWN} more: `dspark check --json` lists the first "
                                      f"{SHOWN}; `find PATH -perm -o+w` finds the rest)" if len(fixes) > SHOWN else "")
    return warn(name, f"others can write {what}: {shown}{more}{why}", fix)


def check_perms(cluster: Cluster, user: ServiceUser, vllm_package: Path | None) -> list[Check]:
    """perms.model, perms.cluster and perms.runtime when others can write them; one ok line
    otherwise. `vllm_package`: the installed vllm package (node_identity.vllm_package), when found."""
    trust = Trust(user)
    scan = Scan(trust)
    out: list[Check] = []
    model = Path(cluster.model.path)
    if model.is_dir():
        scan.tree(model)
        found = scan.take()
        if found:
            why = (" (model.trust_remote_code = true: vLLM runs the model's own Python from there)"
                   if cluster.model.trust_remote_code else "")
            out.append(_report("perms.model", f"the model directory {model}", found, why))
    if cluster.source:
        scan.path(Path(cluster.source))
        found = scan.take()
        if found:
            out.append(_report("perms.cluster", f"the cluster file {cluster.source}", found,
                               " (it says what the node runs, and with which environment)"))
    command = cluster.serving.vllm_command
    first = shutil.which(command[0]) if command else None
    if first:
        scan.path(Path(first))
    if vllm_package is not None:
        scan.children(vllm_package.parent)  # site-packages: a new .pth there runs at every start
        scan.tree(vllm_package)
    found = scan.take()
    if found:
        out.append(_report("perms.runtime", f"vLLM's runtime ({first or command[:1]})", found,
                           f" (its code runs as {user.name})"))
    if not out:
        who = "root" if user.uid == 0 else f"root and {user.name}"
        out.append(ok("perms", f"only {who} can write the model directory, the cluster file and vLLM's runtime "
                               "(mode bits; ACLs not read)"))
    return out
