"""A real Apache Kafka broker, KRaft single node, for development and tests.

Its jars come from Maven Central (``org.apache.kafka:kafka_2.13`` and its runtime
dependencies, via ``mvn dependency:copy-dependencies``) into a cache dir, or from an
unpacked distribution named by ``KAFKA_HOME``. It runs on the machine's Java with a small
heap, detached from the calling process, its pid and logs in the state dir.

The Maven artifact brings slf4j's API but no binding (the distribution ships one in its
libs): without one the broker logs nothing at all, not even why it failed to start. The
binding of Kafka's slf4j (1.7) to its log4j2 is resolved with it, so that the broker
writes ``server.log`` (INFO, the state changes at WARN).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path

from kbtools.devstack.postgres import ServiceStatus
from kbtools.devstack.process import (
    cmdline,
    pid_alive,
    port_bindable,
    port_open,
    read_pid,
    run_tool,
    runs_on_another_port,
    spawn_detached,
    terminate,
)
from kbtools.devstack.settings import DevStackSettings
from services.runtime.errors import ConfigError, DependencyUnavailable, MissingTool

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>kb-pipeline</groupId>
  <artifactId>kafka-runtime</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>{version}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>{log4j}</version>
      <scope>runtime</scope>
    </dependency>
  </dependencies>
</project>
"""

# The log4j2 release Kafka 4.1 runs on (its log4j-api and log4j-core come with the broker);
# the binding for its slf4j 1.7 API is log4j-slf4j-impl (log4j-slf4j2-impl binds slf4j 2).
LOG4J_VERSION = "2.24.3"
# The jar that binds slf4j 1.x (Kafka's) to an implementation: one in the classpath, or the
# broker logs nothing.
SLF4J_BINDER = "org/slf4j/impl/StaticLoggerBinder.class"

# The log rolls over at 10 MB, three kept: each test's topics are logged as they are made.
_LOG4J2 = """status = warn
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = {log}
appender.file.filePattern = {log}.%i
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 10MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = info
logger.state.name = state.change.logger
logger.state.level = warn
"""


def find_java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise MissingTool(
            "Java 17 or newer is needed to run the local Kafka broker. Install it "
            "(Debian/Ubuntu: apt-get install openjdk-17-jre-headless; macOS: brew install "
            "openjdk@17), set JAVA_HOME, or set KAFKA_BOOTSTRAP_SERVERS to use an existing "
            "broker instead."
        )
    return found


class LocalKafka:
    def __init__(self, settings: DevStackSettings) -> None:
        self.settings = settings
        self.dir = settings.kafka_dir
        self.data_dir = self.dir / "data"
        self.pid_file = self.dir / "kafka.pid"
        self.log_file = self.dir / "server.log"
        self.stdout_file = self.dir / "stdout.log"
        self.config_file = self.dir / "server.properties"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.settings.kafka_port}"

    # --- jars -----------------------------------------------------------------------------

    def classpath(self) -> str:
        kafka_home = os.environ.get("KAFKA_HOME")
        if kafka_home:
            libs = Path(kafka_home) / "libs"
            if not any(libs.glob("kafka_2.13-*.jar")):
                raise ConfigError(f"KAFKA_HOME={kafka_home} has no libs/kafka_2.13-*.jar")
            return f"{libs}/*"
        return f"{self.fetch_jars()}/*"

    def fetch_jars(self) -> Path:
        """Resolve the broker's jars once into the cache (atomically: a half-finished
        download never looks complete)."""
        version = self.settings.kafka_version
        pom = _POM.format(version=version, log4j=LOG4J_VERSION)
        # Named by what was resolved: a cache made from another list of artifacts (one
        # without the logging binding) is not taken for this one.
        digest = hashlib.sha256(pom.encode()).hexdigest()[:12]
        target = self.settings.cache_dir / "kafka" / version / f"libs-{digest}"
        if (target / f"kafka_2.13-{version}.jar").exists():
            return target
        mvn = shutil.which("mvn")
        if mvn is None:
            raise MissingTool(
                "Maven (mvn) is needed once to fetch Kafka's jars from Maven Central. Install "
                "it (Debian/Ubuntu: apt-get install maven; macOS: brew install maven), or set "
                "KAFKA_HOME to an unpacked Kafka distribution, or set KAFKA_BOOTSTRAP_SERVERS "
                "to use an existing broker."
            )
        work = target.parent / f"resolve-{uuid.uuid4().hex[:8]}"
        work.mkdir(parents=True)
        try:
            (work / "pom.xml").write_text(pom)
            result = run_tool(
                [
                    mvn,
                    "-q",
                    "-B",
                    "dependency:copy-dependencies",
                    "-DincludeScope=runtime",
                    f"-DoutputDirectory={work / 'libs'}",
                ],
                cwd=work,
                timeout=900,
            )
            if result.returncode != 0:
                raise DependencyUnavailable(
                    f"mvn could not resolve org.apache.kafka:kafka_2.13:{version}: "
                    f"{(result.stdout + result.stderr).strip()[-2000:]}"
                )
            if target.exists():  # another process won the race
                return target
            (work / "libs").rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return target

    def preflight(self) -> None:
        """Everything the broker needs that the machine may lack: Java, and the jars."""
        if self.status().running:
            return
        find_java()
        self.classpath()

    # --- lifecycle ------------------------------------------------------------------------

    def _our_pid(self) -> int | None:
        pid = read_pid(self.pid_file)
        if pid is None or not pid_alive(pid):
            return None
        # A recycled pid belongs to someone else: only a java running our config is ours.
        return pid if str(self.config_file) in cmdline(pid) else None

    def status(self) -> ServiceStatus:
        return ServiceStatus.of_process(
            "kafka",
            read_pid(self.pid_file),
            self._our_pid(),
            self.settings.kafka_port,
            self.data_dir,
            self.bootstrap,
        )

    def _write_config(self) -> None:
        s = self.settings
        properties = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{s.kafka_controller_port}",
            "listeners": (
                f"PLAINTEXT://127.0.0.1:{s.kafka_port},CONTROLLER://127.0.0.1:"
                f"{s.kafka_controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{s.kafka_port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.partitions": "3",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "true",
            "log.retention.hours": "24",
            "log.segment.bytes": str(16 * 1024 * 1024),
        }
        self.config_file.write_text("".join(f"{k}={v}\n" for k, v in properties.items()))
        (self.dir / "log4j2.properties").write_text(_LOG4J2.format(log=self.log_file))

    def _java(self, java: str, classpath: str, *args: str) -> list[str]:
        return [
            java,
            f"-Xms{min(256, self.settings.kafka_heap_mb)}m",
            f"-Xmx{self.settings.kafka_heap_mb}m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
            "-cp",
            classpath,
            *args,
        ]

    def up(self) -> ServiceStatus:
        current = self.status()
        if current.running:
            self._wait_ready(time.monotonic() + self.settings.start_timeout_s)
            return current
        if (pid := self._our_pid()) is not None:
            raise runs_on_another_port("kafka", pid, self.settings.kafka_port, "KB_DEV_KAFKA_PORT")
        if port_open("127.0.0.1", self.settings.kafka_port):
            raise ConfigError(
                f"port {self.settings.kafka_port} is taken by another program; set "
                "KB_DEV_KAFKA_PORT to a free port (or KAFKA_BOOTSTRAP_SERVERS to use that broker)"
            )
        # A port in the kernel's ephemeral range may be held by any client connection for a
        # while: say so before the JVM starts (its log would say only "Address in use").
        for port, setting in (
            (self.settings.kafka_port, "KB_DEV_KAFKA_PORT"),
            (self.settings.kafka_controller_port, "KB_DEV_KAFKA_CONTROLLER_PORT"),
        ):
            if not port_bindable("127.0.0.1", port):
                raise DependencyUnavailable(
                    f"kafka cannot listen on port {port}: another socket holds it (a client "
                    f"connection's end, if it is in the ephemeral range); set {setting} to "
                    "a free port below that range, or try again"
                )
        java = find_java()
        classpath = self.classpath()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        if not (self.data_dir / "meta.properties").exists():
            self.format_storage(java, classpath, _kafka_uuid())
        logged = _size(self.log_file)  # what this start logs comes after
        pid = spawn_detached(
            self._java(java, classpath, "kafka.Kafka", str(self.config_file)), self.stdout_file
        )
        self.pid_file.write_text(f"{pid}\n")
        deadline = time.monotonic() + self.settings.start_timeout_s
        while not port_open("127.0.0.1", self.settings.kafka_port):
            if not pid_alive(pid):
                raise DependencyUnavailable(
                    f"kafka exited during start-up: {self.why_it_stopped(logged)} (see "
                    f"{self.log_file} and {self.stdout_file})"
                )
            if time.monotonic() > deadline:
                raise DependencyUnavailable(f"kafka did not open its port; see {self.log_file}")
            time.sleep(0.2)
        self._wait_ready(deadline)
        return self.status()

    def why_it_stopped(self, logged: int = 0) -> str:
        """The broker's last error in its log after ``logged`` bytes (the exception's line
        after it), else the last line it printed."""
        lines = _lines(self.log_file, logged)
        errors = [i for i, line in enumerate(lines) if " ERROR " in line or " FATAL " in line]
        if errors:
            return " / ".join(line.strip() for line in lines[errors[-1] : errors[-1] + 2])
        printed = _lines(self.stdout_file)
        return printed[-1].strip() if printed else "it logged nothing"

    def format_storage(self, java: str, classpath: str, cluster_id: str) -> None:
        """Format the KRaft log directory for a new single-node cluster."""
        result = run_tool(
            self._java(
                java,
                classpath,
                "kafka.tools.StorageTool",
                "format",
                # One argument with "=": a random id may start with "-", which argparse
                # would take for an option (a separate "-t -Xy..." fails one run in 64).
                f"--cluster-id={cluster_id}",
                "-c",
                str(self.config_file),
                "--standalone",
                "--ignore-formatted",
            ),
            timeout=120,
        )
        if result.returncode != 0:
            raise DependencyUnavailable(
                f"kafka storage format failed: {(result.stdout + result.stderr)[-2000:]}"
            )

    def _wait_ready(self, deadline: float) -> None:
        """The port opens before the broker has joined its own quorum: wait until a
        metadata request names a controller."""
        asyncio.run(_wait_for_metadata(self.bootstrap, deadline))

    def down(self) -> None:
        pid = self._our_pid()
        if pid is not None:
            terminate(pid, grace_s=30)
        self.pid_file.unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _lines(path: Path, offset: int = 0) -> list[str]:
    try:
        with path.open("rb") as file:
            if offset <= _size(path):  # else the log rolled over meanwhile: all of it
                file.seek(offset)
            return file.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def _kafka_uuid() -> str:
    import base64

    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


async def _wait_for_metadata(bootstrap: str, deadline: float) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    last_error: Exception | None = None
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            cluster = await admin.describe_cluster()
            if cluster.get("controller_id", -1) >= 0:
                return
        except Exception as exc:  # any failure here just means "not ready yet"
            last_error = exc
        finally:
            await admin.close()
        await asyncio.sleep(0.3)
    raise DependencyUnavailable(f"kafka at {bootstrap} did not become ready: {last_error!r}")
