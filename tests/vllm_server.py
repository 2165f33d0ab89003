"""Real vLLM servers for the tests: vLLM's OpenAI-compatible server, started from this interpreter on a loopback port,
as docs/vllm.md tells a CPU user to start one."""

import os
import signal
import socket
import subprocess
import sys
import time

import requests


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VLLMServer:
    """One `vllm.entrypoints.openai.api_server` process serving `model` in float32 (development endpoints on, so that
    weights can be reloaded), in its own process group; `stop()` kills the whole group."""

    def __init__(self, model, log_dir, max_model_len=64, extra_args=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"vllm-{self.port}.log")
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_NUM_THREADS": "1",
        }
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--dtype",
            "float32",
            "--max-model-len",
            str(max_model_len),
            "--gpu-memory-utilization",
            "0.05",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--seed",
            "0",
            *extra_args,
        ]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self, timeout=600):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM server not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, lines=40):
        with open(self.log_path) as log:
            return "".join(log.readlines()[-lines:])

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
