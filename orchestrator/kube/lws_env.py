"""What LeaderWorkerSet tells each pod, and the addresses of the group's servers it implies (pure).

The LWS controller sets, in every container of a group's pods (pkg/utils/pod/pod_utils.go, v0.10.0):
`LWS_LEADER_ADDRESS` = `<lws>-<group>.<subdomain>.<namespace>`, `LWS_GROUP_SIZE` (pods in the group, the
leader included) and `LWS_WORKER_INDEX` (0: the leader). Worker `i` of the group is the pod
`<lws>-<group>-<i>`, which the same headless service names `<lws>-<group>-<i>.<subdomain>.<namespace>`:
the first label of the leader's address with `-<i>` added (as LWS's own llama.cpp example derives it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.core.errors import InputError

LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
GROUP_SIZE = "LWS_GROUP_SIZE"
WORKER_INDEX = "LWS_WORKER_INDEX"


@dataclass(frozen=True)
class LwsEnv:
    leader_address: str
    group_size: int
    worker_index: int

    @property
    def is_leader(self) -> bool:
        return self.worker_index == 0


def _integer(env: Mapping[str, str], name: str, minimum: int) -> int:
    text = env.get(name)
    if text is None or not text.strip():
        raise InputError(f"{name} is not set: run this in a LeaderWorkerSet pod, or set it")
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"{name}={text!r} is not a whole number") from None
    if value < minimum:
        raise InputError(f"{name}={value} is below {minimum}")
    return value


def read_lws_env(env: Mapping[str, str]) -> LwsEnv:
    """The LWS variables of `env`; InputError naming the variable that is missing or malformed."""
    address = env.get(LEADER_ADDRESS, "").strip()
    if not address:
        raise InputError(f"{LEADER_ADDRESS} is not set: run this in a LeaderWorkerSet pod, or set it")
    first = address.split(".", 1)[0]
    if not first or any(c.isspace() for c in address) or ":" in address:
        raise InputError(f"{LEADER_ADDRESS}={address!r} is not a DNS name (<lws>-<group>.<service>...)")
    if first.isdigit():
        # an IP address: the workers' names are derived from the first label (`10` -> `10-1.0.0.1`), which
        # would resolve nowhere and fail only when the wait for the group runs out
        raise InputError(
            f"{LEADER_ADDRESS}={address!r} is an address, not the leader's DNS name: the workers' names are "
            "derived from its first label (<lws>-<group>-<index>.<service>...)",
            hint="LeaderWorkerSet sets it to the leader's name in its headless service; do not override it",
        )
    size = _integer(env, GROUP_SIZE, 1)
    index = _integer(env, WORKER_INDEX, 0)
    if index >= size:
        raise InputError(f"{WORKER_INDEX}={index} is not below {GROUP_SIZE}={size}")
    return LwsEnv(address, size, index)


def worker_address(leader_address: str, index: int) -> str:
    """Worker `index`'s DNS name: `<lws>-<group>-<index>.<rest of the leader's address>`."""
    first, _, rest = leader_address.partition(".")
    return f"{first}-{index}" + (f".{rest}" if rest else "")


def group_addresses(lws: LwsEnv) -> list[str]:
    """The hosts of the group's servers in pod order, as the leader reaches them: itself (loopback: its
    rpc-server is a container of its own pod), then each worker by name."""
    return ["127.0.0.1"] + [worker_address(lws.leader_address, i) for i in range(1, lws.group_size)]
