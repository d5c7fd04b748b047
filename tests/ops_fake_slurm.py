"""A stateful fake of the Slurm commands gpuguard's operations side calls, as real
executables (``scontrol``, ``sinfo``) in a bin dir: node state and reasons live in a JSON
file, so drains, resumes, an admin's re-drain and MAINT reservations behave like Slurm
22.05's output (formats as measured on the testbed: SLURM-FACTS.md §6b)."""

from __future__ import annotations

import json
import pathlib

SCRIPT = r'''#!/usr/bin/env python3
import json, sys, os, time
state_path = STATE
tool = os.path.basename(sys.argv[0]); args = sys.argv[1:]
st = json.load(open(state_path))
st.setdefault("calls", []).append([tool] + args)
def save(): json.dump(st, open(state_path, "w"))
def stamp(): st["clock"] = st.get("clock", 0) + 1; return "%s@2026-11-30T18:%02d:%02d" % (st.get("user", "root"), st["clock"] // 60, st["clock"] % 60)
out = ""
if tool == "scontrol" and args[:2] == ["show", "node"]:
    name = [a for a in args[2:] if a != "-o"][0]
    n = st["nodes"].get(name)
    if n is None:
        save(); print("Node %s not found" % name, file=sys.stderr); sys.exit(1)
    r = (" Reason=%s [%s]" % (n["reason"], n["stamp"])) if n.get("reason") else ""
    out = "NodeName=%s Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 State=%s ThreadsPerCore=1 Partitions=gpu%s\n" % (name, n["state"], r)
elif tool == "scontrol" and args[:1] == ["update"]:
    kv = dict(a.split("=", 1) for a in args[1:])
    n = st["nodes"][kv["nodename"]]
    if kv["state"] == "drain":
        n["state"] = n["state"].split("+")[0] + "+DRAIN"; n["reason"] = kv["reason"]; n["stamp"] = stamp()
    elif kv["state"] == "resume":
        n["state"] = n["state"].split("+")[0]; n["reason"] = None; n["stamp"] = None
elif tool == "scontrol" and args[:2] == ["show", "reservation"]:
    out = st.get("reservations") or "No reservations in the system\n"
elif tool == "scontrol" and args[:2] == ["show", "config"]:
    out = "MailProg                = /bin/true\n"
elif tool == "sinfo":
    for name, n in sorted(st["nodes"].items()):
        if n.get("reason"):
            out += "%s|%s|%s|%s\n" % (n["reason"], "root(0)", n["stamp"].split("@")[1], name)
save()
sys.stdout.write(out)
'''


class FakeSlurm:
    """``bindir`` holds ``scontrol`` and ``sinfo``; ``node(name)`` reads a node's state."""

    def __init__(self, root: pathlib.Path, nodes=("n1", "n2")):
        self.bindir = root / "bin"
        self.bindir.mkdir(exist_ok=True)
        self.state = root / "slurm-state.json"
        self.state.write_text(json.dumps({"nodes": {n: {"state": "IDLE", "reason": None, "stamp": None} for n in nodes}}))
        for tool in ("scontrol", "sinfo"):
            f = self.bindir / tool
            f.write_text(SCRIPT.replace("STATE", repr(str(self.state))))
            f.chmod(0o755)

    def _load(self) -> dict:
        return json.loads(self.state.read_text())

    def node(self, name: str) -> dict:
        return self._load()["nodes"][name]

    def set(self, **kw) -> None:
        st = self._load()
        st.update(kw)
        self.state.write_text(json.dumps(st))

    def admin_drain(self, name: str, reason: str, user: str = "admin") -> None:
        """What an administrator's ``scontrol update state=drain reason=...`` does."""
        st = self._load()
        st["clock"] = st.get("clock", 0) + 1
        n = st["nodes"][name]
        n["state"] = n["state"].split("+")[0] + "+DRAIN"
        n["reason"] = reason
        n["stamp"] = f"{user}@2026-11-30T19:00:{st['clock'] % 60:02d}"
        self.state.write_text(json.dumps(st))

    def updates(self) -> list[list[str]]:
        return [c for c in self._load().get("calls", []) if c[:2] == ["scontrol", "update"]]
