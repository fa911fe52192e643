"""The Pod Security Standards' "restricted" profile as a check of a pod template, offline: no cluster runs
here to admit the pods (a namespace labelled `pod-security.kubernetes.io/enforce: restricted`), so its
documented controls are applied as written (https://kubernetes.io/docs/concepts/security/
pod-security-standards/, the baseline's controls and the restricted ones, Kubernetes 1.33):

- baseline: no HostProcess, no host namespaces, no privileged container, capabilities added only from
  the default set, no hostPath volume, no host port, AppArmor only RuntimeDefault or Localhost, SELinux
  only the container types and no user or role, the default /proc mount, seccomp never Unconfined, only
  the safe sysctls;
- restricted: only the core volume types, `allowPrivilegeEscalation: false` in every container,
  `runAsNonRoot: true` (the pod's, or every container's) and no `runAsUser: 0`, a seccomp profile of
  RuntimeDefault or Localhost (the pod's, or every container's), every container dropping ALL
  capabilities and adding at most NET_BIND_SERVICE.

`restricted_violations` returns each broken control as a line naming the field (empty: admitted)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
SECCOMP_TYPES = frozenset({"RuntimeDefault", "Localhost"})
APPARMOR_TYPES = frozenset({"RuntimeDefault", "Localhost"})


def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(kind) or []:
            yield f"spec.{kind}[{container.get('name', '?')}]", container


def _context_checks(where: str, context: dict[str, Any]) -> list[str]:
    """The controls a pod's and a container's securityContext share."""
    wrong = []
    if (context.get("windowsOptions") or {}).get("hostProcess"):
        wrong.append(f"{where}.windowsOptions.hostProcess must be false")
    selinux = context.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        wrong.append(f"{where}.seLinuxOptions: only a container type, no user or role")
    apparmor = (context.get("appArmorProfile") or {}).get("type")
    if apparmor is not None and apparmor not in APPARMOR_TYPES:
        wrong.append(f"{where}.appArmorProfile.type {apparmor!r}")
    seccomp = (context.get("seccompProfile") or {}).get("type")
    if seccomp is not None and seccomp not in SECCOMP_TYPES:
        wrong.append(f"{where}.seccompProfile.type {seccomp!r}: RuntimeDefault or Localhost")
    if context.get("runAsNonRoot") is False:
        wrong.append(f"{where}.runAsNonRoot is false")
    if context.get("runAsUser") == 0:
        wrong.append(f"{where}.runAsUser is 0 (root)")
    return wrong


def restricted_violations(template: dict[str, Any]) -> list[str]:
    """What of the pod template (`metadata`, `spec`) the restricted profile refuses, one line each."""
    spec = template.get("spec") or {}
    pod = spec.get("securityContext") or {}
    wrong = _context_checks("spec.securityContext", pod)
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            wrong.append(f"spec.{field} must be false")
    for sysctl in pod.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            wrong.append(f"spec.securityContext.sysctls: {sysctl.get('name')} is not a safe sysctl")
    for key, value in ((template.get("metadata") or {}).get("annotations") or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            wrong.append(f"metadata.annotations[{key}] {value!r}")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= VOLUME_TYPES:
            wrong.append(f"spec.volumes[{volume.get('name')}]: {', '.join(sorted(kinds - VOLUME_TYPES))}")
    pod_non_root = pod.get("runAsNonRoot") is True
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type") in SECCOMP_TYPES
    for where, container in _containers(spec):
        context = container.get("securityContext") or {}
        at = f"{where}.securityContext"
        wrong += _context_checks(at, context)
        if context.get("privileged"):
            wrong.append(f"{at}.privileged must be false")
        if context.get("procMount", "Default") != "Default":
            wrong.append(f"{at}.procMount must be Default")
        if any(port.get("hostPort") for port in container.get("ports") or []):
            wrong.append(f"{where}.ports: no hostPort")
        if context.get("allowPrivilegeEscalation") is not False:
            wrong.append(f"{at}.allowPrivilegeEscalation must be false")
        if not pod_non_root and context.get("runAsNonRoot") is not True:
            wrong.append(f"{at}.runAsNonRoot must be true (or the pod's)")
        if not pod_seccomp and (context.get("seccompProfile") or {}).get("type") not in SECCOMP_TYPES:
            wrong.append(f"{at}.seccompProfile.type must be RuntimeDefault or Localhost (or the pod's)")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            wrong.append(f"{at}.capabilities.drop must hold ALL")
        added = set(capabilities.get("add") or [])
        if not added <= BASELINE_CAPABILITIES:
            wrong.append(f"{at}.capabilities.add: {', '.join(sorted(added - BASELINE_CAPABILITIES))}")
        elif added - {"NET_BIND_SERVICE"}:
            wrong.append(f"{at}.capabilities.add: only NET_BIND_SERVICE")
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            wrong.append(f"spec.volumes[{volume.get('name')}].hostPath is forbidden")
    return wrong
