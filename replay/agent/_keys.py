"""The agents' keys in the job's store, all under ``swiftlog/{run}/agent/``.

- ``node/{n}``: node ``n``'s registration (JSON: host address, host name, spare or not, free memory);
- ``hb/{n}``: node ``n``'s heartbeat, a counter its agent increments (the leader times its changes
  on its own clock: no clock of another host is compared);
- ``cmd/{n}/{seq}`` and ``cmd/{n}/count``: the leader's commands to node ``n`` (start or kill a
  process), numbered from 1;
- ``exit/{name}``: how process ``name`` ended (JSON: return code, the error it raised);
- ``lost/{n}``: the leader declared node ``n`` lost (its agent, if it still runs, kills its
  processes and exits: a node declared lost never comes back with stale ranks);
- ``spares``: the counter that numbers spare nodes (after the ``nnodes`` regular ones);
- ``done``: set by the leader when the job is over (every agent then stops its processes and exits).

Never: holds training state; the recovery protocol's keys are :class:`trainer_client.RecoveryKeys`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AgentKeys"]


@dataclass(frozen=True, slots=True)
class AgentKeys:
    run_id: str

    @property
    def prefix(self) -> str:
        return f"swiftlog/{self.run_id}/agent"

    def node(self, n: int) -> str:
        return f"{self.prefix}/node/{n}"

    def heartbeat(self, n: int) -> str:
        return f"{self.prefix}/hb/{n}"

    def command(self, n: int, seq: int) -> str:
        return f"{self.prefix}/cmd/{n}/{seq}"

    def command_count(self, n: int) -> str:
        return f"{self.prefix}/cmd/{n}/count"

    def exit(self, name: str) -> str:
        return f"{self.prefix}/exit/{name}"

    def lost(self, n: int) -> str:
        return f"{self.prefix}/lost/{n}"

    def spares(self) -> str:
        return f"{self.prefix}/spares"

    def done(self) -> str:
        return f"{self.prefix}/done"
