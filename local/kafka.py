"""A real single-node Apache Kafka (KRaft: one broker+controller) on 127.0.0.1.

The jars come from Maven Central through `mvn dependency:copy-dependencies`
(org.apache.kafka:kafka_2.13 and everything it needs at run time) into a cache
under CRUCIBLE_HOME, fetched once per version. The broker runs from those jars
with the JDK on the machine; it is stopped by the PID we recorded, after
checking that the PID is still our broker.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from crucible.shared.procs import read_pid, terminate
from crucible.shared.settings import Settings, get_settings

# The local broker's JVM: the client compiler only (tiered compilation's second compiler was still
# compiling a minute into a run, a third of the broker's CPU), and the serial collector (one thread,
# which is plenty for a heap this size).
JVM_OPTIONS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")

POM_TEMPLATE = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.crucible</groupId>
  <artifactId>kafka-runtime</artifactId>
  <version>1</version>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>{version}</version>
    </dependency>
    <!-- Kafka logs through slf4j 1.x; without a binding it would log nothing. -->
    <dependency>
      <groupId>org.slf4j</groupId>
      <artifactId>slf4j-simple</artifactId>
      <version>1.7.36</version>
    </dependency>
  </dependencies>
</project>
"""


class KafkaError(RuntimeError):
    """Something the user can act on went wrong with the local broker."""


def jars_dir(settings: Settings | None = None) -> Path:
    settings = settings or get_settings()
    return settings.home / "kafka" / settings.kafka_version / "libs"


def ensure_jars(settings: Settings | None = None, *, echo=print) -> Path:
    """Fetches Kafka's runtime jars with Maven once; returns the folder holding them."""
    settings = settings or get_settings()
    libs = jars_dir(settings)
    marker = libs / ".complete"
    if marker.exists():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaError("Maven (mvn) is not installed: run ./crucible once, or `apt-get install maven`")
    work = libs.parent
    work.mkdir(parents=True, exist_ok=True)
    (work / "pom.xml").write_text(POM_TEMPLATE.format(version=settings.kafka_version))
    tmp = work / "libs.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    echo(f"fetching Apache Kafka {settings.kafka_version} (org.apache.kafka:kafka_2.13 and its "
         f"runtime dependencies) from Maven Central into {libs} ...")
    started = time.monotonic()
    proc = subprocess.run(
        [mvn, "-B", "-q", "-f", str(work / "pom.xml"), "dependency:copy-dependencies",
         f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise KafkaError(
            f"mvn could not fetch org.apache.kafka:kafka_2.13:{settings.kafka_version} "
            f"(exit {proc.returncode}):\n{tail}\n"
            "Set CRUCIBLE_KAFKA_VERSION to a served version, or point CRUCIBLE_KAFKA_BOOTSTRAP at another broker."
        )
    jars = list(tmp.glob("*.jar"))
    if not any(j.name.startswith("kafka_2.13-") for j in jars):
        raise KafkaError(f"mvn finished but {tmp} holds no kafka_2.13 jar: {sorted(j.name for j in jars)}")
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    marker.write_text(f"{len(jars)} jars\n")
    echo(f"fetched {len(jars)} jars in {time.monotonic() - started:.1f}s")
    return libs


def java_binary() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise KafkaError("no Java runtime found: Kafka 4 needs Java 17+ (`apt-get install openjdk-17-jre-headless`)")
    return java


@dataclass
class LocalKafka:
    """One KRaft broker+controller whose data, config, log and PID file live in `root`."""

    root: Path
    port: int = 9092
    controller_port: int = 9093
    heap: str = "1g"
    settings: Settings | None = None
    # A second listener that takes SASL/PLAIN logins from these users ({name: password}), where
    # clients prove the bus's SASL settings (tests); none by default.
    sasl_port: int | None = None
    sasl_users: dict | None = None

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> "LocalKafka":
        settings = settings or get_settings()
        host, port = settings.kafka_host_port
        if host not in ("127.0.0.1", "localhost"):
            raise KafkaError(f"CRUCIBLE_KAFKA_BOOTSTRAP={settings.kafka_bootstrap} is not local: "
                             "the local broker only runs on 127.0.0.1")
        return cls(settings.home / "kafka" / "broker", port, settings.kafka_controller_port, settings=settings)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.root / "kafka.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "kafka.log"

    @property
    def config_file(self) -> Path:
        return self.root / "server.properties"

    def _write_config(self) -> None:
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        sasl = f",SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}" if self.sasl_port else ""
        users = " ".join(f'user_{name}="{password}"' for name, password in (self.sasl_users or {}).items())
        self.config_file.write_text("\n".join([
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
            f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}{sasl}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}{sasl}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
            *(["sasl.enabled.mechanisms=PLAIN",
               "listener.name.sasl_plaintext.plain.sasl.jaas.config="
               f"org.apache.kafka.common.security.plain.PlainLoginModule required {users};"] if sasl else []),
            f"log.dirs={data}",
            "num.partitions=1",
            "auto.create.topics.enable=true",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=4",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "group.initial.rebalance.delay.ms=0",
            # The controller appends a no-op record to the metadata log whenever it has been idle this
            # long (500 ms by default), so that brokers elsewhere see it alive; this broker is its own
            # controller. At 500 ms they were about a third of an idle broker's CPU (27.5 -> 16 ms a second).
            "metadata.max.idle.interval.ms=5000",
            "message.max.bytes=17825792",
            "log.retention.hours=168",
            # a deleted topic's files (a finished run's) go a second later, not a minute: the broker of a
            # short run is stopped before a minute passes, and its next start would carry them again
            "file.delete.delay.ms=1000",
            "",
        ]))

    def _java(self, libs: Path, *args: str, heap: str | None = None) -> list[str]:
        cmd = [java_binary()]
        if heap:
            cmd += [f"-Xms{min(256, _megabytes(heap))}m", f"-Xmx{heap}"]
        return cmd + [*JVM_OPTIONS, "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
                      "-Dorg.slf4j.simpleLogger.log.kafka.server.KafkaRaftServer=info",
                      "-cp", f"{libs}/*", *args]

    def pid(self) -> int | None:
        """The broker's PID if it is running (and really is this broker), else None."""
        return read_pid(self.pid_file, str(self.config_file).encode())

    def start(self, *, timeout: float = 90.0, echo=print) -> float:
        """Formats storage if new, starts the broker and waits until it serves; returns seconds taken."""
        if (pid := self.pid()) is not None:
            self.wait_ready(timeout=timeout)
            echo(f"Kafka already running (pid {pid}) on {self.bootstrap}")
            return 0.0
        libs = ensure_jars(self.settings, echo=echo)
        for port in (self.port, self.controller_port):
            if _port_open(port):
                raise KafkaError(f"127.0.0.1:{port} is taken by another process; set CRUCIBLE_KAFKA_BOOTSTRAP "
                                 "and CRUCIBLE_KAFKA_CONTROLLER_PORT to free ports")
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_config()
        started = time.monotonic()
        if not (self.root / "data" / "meta.properties").exists():
            cluster_id = _kafka_uuid()
            fmt = subprocess.run(
                self._java(libs, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",  # an id may start with "-"
                           "-c", str(self.config_file)),
                capture_output=True, text=True, stdin=subprocess.DEVNULL,
            )
            if fmt.returncode != 0:
                raise KafkaError(f"formatting KRaft storage failed:\n{fmt.stdout}{fmt.stderr}")
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                self._java(libs, "kafka.Kafka", str(self.config_file), heap=self.heap),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in the launching shell does not kill the broker
            )
        self.pid_file.write_text(f"{proc.pid}\n")
        try:
            self.wait_ready(timeout=timeout, proc=proc)
        except KafkaError:
            self.stop()
            raise
        return time.monotonic() - started

    def wait_ready(self, *, timeout: float = 90.0, proc: subprocess.Popen | None = None) -> None:
        """Waits until the broker answers a metadata request on its listener."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise KafkaError(f"Kafka exited with code {proc.returncode} while starting; "
                                 f"last lines of {self.log_file}:\n{self.log_tail()}")
            if _port_open(self.port) and broker_answers(self.bootstrap):
                return
            time.sleep(0.2)
        raise KafkaError(f"Kafka did not answer on {self.bootstrap} within {timeout:.0f}s; "
                         f"last lines of {self.log_file}:\n{self.log_tail()}")

    def stop(self, *, timeout: float = 30.0) -> bool:
        """Stops the broker by its PID (SIGTERM, then SIGKILL); returns whether one was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        terminate(pid, timeout)
        self.pid_file.unlink(missing_ok=True)
        return True

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def broker_answers(bootstrap: str, timeout: float = 5.0) -> bool:
    """True when a Kafka client can fetch cluster metadata from `bootstrap`."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    async def probe() -> bool:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000))
        try:
            await asyncio.wait_for(admin.start(), timeout)
            await asyncio.wait_for(admin.describe_cluster(), timeout)
            return True
        except Exception:
            return False
        finally:
            await admin.close()

    return asyncio.run(probe())


def _kafka_uuid() -> str:
    import base64

    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _megabytes(size: str) -> int:
    units = {"g": 1024, "m": 1, "k": 1 / 1024}
    return int(float(size[:-1]) * units[size[-1].lower()]) if size[-1].lower() in units else int(size) // 2**20
