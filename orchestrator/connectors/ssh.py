"""The SSH connector (asyncssh): the only module that imports asyncssh."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import warnings
from pathlib import Path
from typing import Any

from orchestrator.connectors.base import (
    CLOSE_TIMEOUT,
    SFTP_BLOCK,
    BaseConnection,
    ConnectOptions,
    Progress,
    ProgressReporter,
    decode,
    signal_status,
)
from orchestrator.core.errors import (
    AuthenticationError,
    HostKeyError,
    TransferError,
    UnreachableError,
)
from orchestrator.core.log import get_logger
from orchestrator.inventory.model import Host

# asyncssh (2.24) names cryptography's DSA types as it is imported, and cryptography 48+ warns on each
# name: ten lines on every command, whatever keys are used. Only that warning, from asyncssh, is dropped.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh(\.|$)")
import asyncssh  # noqa: E402  (after the filter, which it needs at import)

_RELEASE_TIMEOUT = 1.0

_warned_unchecked: set[tuple[str, str, int]] = set()


_CIPHERS = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes128-ctr",
    "aes256-ctr",
)


def _known_hosts_path(host: Host) -> Path:
    if host.ssh_known_hosts:
        return Path(host.ssh_known_hosts).expanduser()
    return Path.home() / ".ssh" / "known_hosts"


def _where(host: Host) -> str:
    return f"{host.address}:{host.ssh_port}"


class SSHConnection(BaseConnection):
    """A connection over SSH (asyncssh), opened with `SSHConnection.open` or `connect`."""

    def __init__(self, host: Host, options: ConnectOptions, conn: asyncssh.SSHClientConnection) -> None:
        self.host = host
        self.options = options
        self._conn = conn
        self._sftp: asyncssh.SFTPClient | None = None
        self._sftp_lock = asyncio.Lock()

    @classmethod
    async def open(cls, host: Host, options: ConnectOptions | None = None) -> SSHConnection:
        options = options or ConnectOptions()
        timeout = options.connect_timeout_for(host)
        kwargs = cls._client_options(host, options, timeout)
        log = get_logger(host=host.name)
        try:
            # asyncssh's connect_timeout covers TCP, key exchange and auth; this outer bound only
            # guards against it not firing.
            async with asyncio.timeout(timeout + 2.0):
                conn = await asyncssh.connect(host.address, **kwargs)
        except asyncssh.PermissionDenied as exc:
            raise cls._auth_error(host, str(exc.reason)) from None
        except asyncssh.HostKeyNotVerifiable as exc:
            raise cls._host_key_error(host, str(exc.reason)) from None
        except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as exc:  # e.g. IdentityFile
            raise AuthenticationError(
                f"cannot load an SSH key for {_where(host)}: {exc}",
                host=host.name,
                hint="use an unencrypted key file or load the key into ssh-agent",
            ) from None
        except ConnectionRefusedError:
            raise UnreachableError(f"connection refused by {_where(host)}", host=host.name) from None
        except TimeoutError:  # before OSError: TimeoutError is an OSError
            raise UnreachableError(
                f"connection to {_where(host)} timed out after {timeout:g} s", host=host.name
            ) from None
        except OSError as exc:  # unreachable network, unknown name, reset
            raise UnreachableError(
                f"cannot connect to {_where(host)}: {exc.strerror or exc}", host=host.name
            ) from None
        except asyncssh.Error as exc:  # protocol errors, disconnects during the handshake
            raise UnreachableError(
                f"cannot connect to {_where(host)}: {exc.reason}", host=host.name
            ) from None
        log.debug("ssh_connected", address=host.address, port=host.ssh_port)
        return cls(host, options, conn)

    @staticmethod
    def _client_options(host: Host, options: ConnectOptions, timeout: float) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "connect_timeout": timeout,
            "keepalive_interval": options.keepalive_interval,
            "keepalive_count_max": options.keepalive_count_max,
            # AES-GCM first (AES-NI in `cryptography`): 1.5x chacha20's rate here for bulk uploads
            # (tensor-cache warming: 141 against 91 MB/s over one lab link); the rest as asyncssh's default.
            "encryption_algs": list(_CIPHERS),
        }
        # Host/User/Port/IdentityFile from ~/.ssh/config apply where the inventory leaves them unset.
        config = Path.home() / ".ssh" / "config"
        kwargs["config"] = [str(config)] if config.is_file() else None
        if host.ssh_port != 22:  # 22 is the default: leave room for a Port line in ~/.ssh/config
            kwargs["port"] = host.ssh_port
        if host.ssh_user:
            kwargs["username"] = host.ssh_user
        if host.ssh_key:
            path = Path(host.ssh_key).expanduser()
            try:
                kwargs["client_keys"] = [asyncssh.read_private_key(str(path))]
            except OSError as exc:
                raise AuthenticationError(
                    f"cannot read ssh_key {path}: {exc.strerror or exc}", host=host.name
                ) from None
            except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as exc:
                raise AuthenticationError(
                    f"cannot load ssh_key {path}: {exc}",
                    host=host.name,
                    hint="use an unencrypted key file or load the key into ssh-agent and unset ssh_key",
                ) from None
        if host.ssh_host_key_checking:
            known = _known_hosts_path(host)
            # A missing file trusts nothing; the error then says the key is unknown.
            kwargs["known_hosts"] = str(known) if known.is_file() else b""
        else:
            kwargs["known_hosts"] = None
            ident = (host.name, host.address, host.ssh_port)
            if ident not in _warned_unchecked:
                _warned_unchecked.add(ident)
                get_logger(host=host.name).warning(
                    "host_key_checking_disabled", address=host.address, port=host.ssh_port
                )
        return kwargs

    @staticmethod
    def _auth_error(host: Host, reason: str) -> AuthenticationError:
        user = host.ssh_user or "the default user (~/.ssh/config User, else the local user)"
        keys = (
            f"key {host.ssh_key}"
            if host.ssh_key
            else "ssh-agent and the default keys (~/.ssh/config IdentityFile, ~/.ssh/id_*)"
        )
        return AuthenticationError(
            f"authentication failed at {_where(host)}: {reason}",
            host=host.name,
            hint=f"tried user {user} with {keys}; check ssh_user / ssh_key and the remote authorized_keys",
        )

    @staticmethod
    def _host_key_error(host: Host, reason: str) -> HostKeyError:
        known = _known_hosts_path(host)
        target = host.address if host.ssh_port == 22 else f"[{host.address}]:{host.ssh_port}"
        listed = False
        if known.is_file():
            with contextlib.suppress(Exception):  # only for the wording of the hint
                port = None if host.ssh_port == 22 else host.ssh_port
                listed = bool(asyncssh.match_known_hosts(str(known), host.address, host.address, port)[0])
        if listed:
            return HostKeyError(
                f"host key of {_where(host)} does not match {known}",
                host=host.name,
                hint=(
                    "the host presents a different key than recorded: if it was reinstalled, verify the "
                    f"new key and replace the entry (ssh-keygen -f {known} -R '{target}')"
                ),
            )
        missing = "" if known.is_file() else " (the file does not exist)"
        return HostKeyError(
            f"host key of {_where(host)} is unknown: not in {known}{missing}",
            host=host.name,
            hint=(
                f"verify the key and add it (ssh-keyscan -p {host.ssh_port} {host.address} >> {known}), "
                "point ssh_known_hosts at a file that lists it, or set ssh_host_key_checking: false"
            ),
        )

    def _lost(self, what: str, exc: BaseException) -> UnreachableError:
        reason = (
            getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        )
        return UnreachableError(
            f"connection to {_where(self.host)} lost {what}: {reason}", host=self.host.name
        )

    async def _execute(self, command: str, limit: float, data: bytes | None) -> tuple[int, bytes, bytes]:
        process: asyncssh.SSHClientProcess[bytes] | None = None
        try:
            async with asyncio.timeout(limit):
                process = await self._conn.create_process(command, encoding=None)
                if data:
                    stdout, stderr = await process.communicate(data)
                else:
                    process.stdin.write_eof()  # like `ssh host cmd </dev/null`: nothing waits on stdin
                    stdout, stderr = await process.communicate()
        except TimeoutError:
            stdout, stderr = process.collect_output() if process is not None else (b"", b"")
            if process is not None:
                # Best effort: ask sshd to kill the command, then drop the channel either way.
                with contextlib.suppress(Exception):
                    process.kill()
                process.close()
            raise self._timed_out(command, limit, stdout, stderr) from None
        except asyncssh.ChannelOpenError as exc:
            if self._conn.is_closed():
                raise self._lost("before running the command", exc) from None
            raise UnreachableError(
                f"{_where(self.host)} refused to run a command: {exc.reason}", host=self.host.name
            ) from None
        except (asyncssh.Error, OSError) as exc:
            raise self._lost("while running the command", exc) from None
        except BaseException:  # cancelled by the caller: neither the command nor its channel lives on
            if process is not None:
                with contextlib.suppress(Exception):
                    process.kill()  # sshd would otherwise let it run on after the channel closes
                process.close()
            raise

        status = process.exit_status
        exit_signal = process.exit_signal
        if exit_signal is not None:
            status = signal_status(exit_signal[0])
        if status is None:
            # The channel closed without an exit status: the connection went away under it.
            raise UnreachableError(
                f"connection to {_where(self.host)} lost while running the command",
                host=self.host.name,
                command=command,
                stderr=decode(stderr),
            )
        return status, stdout, stderr

    async def hold(self, command: str) -> _HeldSSHCommand:
        try:
            process = await self._conn.create_process(command, encoding="utf-8", errors="replace")
        except asyncssh.ChannelOpenError as exc:
            raise self._lost("before running the command", exc) from None
        except (asyncssh.Error, OSError) as exc:
            raise self._lost("while starting the command", exc) from None
        return _HeldSSHCommand(self, process)

    async def _sftp_client(self) -> asyncssh.SFTPClient:
        async with self._sftp_lock:
            if self._sftp is None:
                limit = self.options.connect_timeout_for(self.host)
                try:
                    async with asyncio.timeout(limit):
                        self._sftp = await self._conn.start_sftp_client()
                except TimeoutError:
                    raise TransferError(
                        f"SFTP did not start within {limit:g} s", host=self.host.name
                    ) from None
                except asyncssh.ChannelOpenError as exc:
                    if self._conn.is_closed():
                        raise self._lost("before starting SFTP", exc) from None
                    raise TransferError(f"SFTP unavailable: {exc.reason}", host=self.host.name) from None
                except (asyncssh.Error, OSError) as exc:
                    raise self._lost("while starting SFTP", exc) from None
            return self._sftp

    def _transfer_error(self, action: str, exc: BaseException) -> Exception:
        if isinstance(exc, asyncssh.SFTPError):
            return TransferError(f"{action}: {exc.reason}", host=self.host.name)
        if isinstance(exc, (asyncssh.Error, ConnectionError)) or self._conn.is_closed():
            return self._lost(f"during transfer ({action})", exc)
        # A local file error.
        assert isinstance(exc, OSError)
        where = f" ({exc.filename})" if exc.filename else ""
        return TransferError(f"{action}: {exc.strerror or exc}{where}", host=self.host.name)

    async def put(self, local: Path, remote: str, *, progress: Progress | None = None) -> None:
        path = _sftp_path(remote, self.host)
        action = f"cannot upload {local} to {remote}"
        try:
            info = await asyncio.to_thread(local.stat)
        except OSError as exc:
            raise TransferError(f"{action}: {exc.strerror or exc}", host=self.host.name) from None
        reporter = ProgressReporter(progress)
        sftp = await self._sftp_client()
        try:
            # Blocks of at most 256 KiB (OpenSSH's limit is about that) keep progress reports
            # frequent; asyncssh pipelines many requests, so throughput does not suffer.
            block = min(sftp.limits.max_write_len or SFTP_BLOCK, SFTP_BLOCK)
            await sftp.put(str(local), path, block_size=block, progress_handler=reporter.sftp_handler)
            # Like scp and OpenSSH's sftp: the copy keeps the file's permission bits.
            await sftp.chmod(path, info.st_mode & 0o7777)
        except (asyncssh.Error, OSError) as exc:
            raise self._transfer_error(action, exc) from None
        reporter.finish(info.st_size)

    async def get(self, remote: str, local: Path) -> None:
        path = _sftp_path(remote, self.host)
        sftp = await self._sftp_client()
        try:
            await sftp.get(path, str(local))
        except (asyncssh.Error, OSError) as exc:
            raise self._transfer_error(f"cannot download {remote} to {local}", exc) from None

    async def another(self) -> SSHConnection:
        return await SSHConnection.open(self.host, self.options)

    def abort(self) -> None:
        sock = self._conn.get_extra_info("socket")
        if sock is not None:  # linger 0: close() resets, dropping the unsent bytes the kernel holds
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._sftp = None
        self._conn.abort()

    async def close(self) -> None:
        if self._sftp is not None:
            self._sftp.exit()
            self._sftp = None
        self._conn.close()
        with contextlib.suppress(TimeoutError, asyncssh.Error, OSError):
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await self._conn.wait_closed()


def _sftp_path(remote: str, host: Host) -> str:
    """SFTP has no ~: sshd's SFTP server starts in the home directory, so ~/x is the relative path x."""
    if remote in ("~", "~/"):
        return "."
    if remote.startswith("~/"):
        return remote[2:]
    if remote.startswith("~"):
        raise TransferError(
            f"remote path {remote!r}: only ~/ (the login user's home) is supported", host=host.name
        )
    return remote


class _HeldSSHCommand:
    def __init__(self, conn: SSHConnection, process: asyncssh.SSHClientProcess[str]) -> None:
        self._conn = conn
        self._process = process

    async def readline(self, timeout: float) -> str | None:  # noqa: ASYNC109
        try:
            async with asyncio.timeout(timeout):
                line = await self._process.stdout.readline()
        except TimeoutError:
            raise self._conn._timed_out("(held command)", timeout, b"", b"") from None
        except (asyncssh.Error, OSError) as exc:
            raise self._conn._lost("while holding a command", exc) from None
        return line.rstrip("\n") if line else None

    async def send(self, data: str) -> bool:
        if self._process.is_closing():
            return False
        try:
            self._process.stdin.write(data)
        except (asyncssh.Error, OSError):
            return False
        return True

    async def release(self) -> None:
        with contextlib.suppress(Exception):
            self._process.stdin.write_eof()
        try:
            # A command that reads its stdin exits at once; one that does not (still waiting for
            # something) has its channel closed after a second.
            async with asyncio.timeout(_RELEASE_TIMEOUT):
                await self._process.wait_closed()
        except (TimeoutError, Exception):
            with contextlib.suppress(Exception):
                self._process.kill()
        finally:
            self._process.close()
