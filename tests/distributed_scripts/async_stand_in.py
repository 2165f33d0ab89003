"""A stand-in for the rollout server of asynchronous rollouts (`max_staleness`), for the faults a real vLLM server cannot
be made to show: a request that never ends, an error injected on one process. tests/test_vllm_async.py runs the real
one.

A loopback HTTP server answers every completion request with the same completion after `delay` seconds, or, from its
`hang_from`-th request on, after `hang_seconds` (or `release`). The client talks to it through a `requests.Session`, as TRL's
`VLLMClient` does, so that a request in flight holds a real socket. Imported by tests/test_async_rollouts.py and by the
launched scripts of this folder.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        server = self.server
        prompts = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        with server.guard:
            server.requests += 1
            hangs = server.hang_from is not None and server.requests >= server.hang_from
            server.in_flight += 1
            server.received.notify_all()
        if hangs:
            server.release.wait(server.hang_seconds)
        else:
            time.sleep(server.delay)
        with server.guard:
            server.in_flight -= 1  # before the answer: a weight sync after it is never counted as overlapping
        completion = server.completion
        body = json.dumps(
            {"completion_ids": [completion] * len(prompts), "logprobs": [[[-1.0]] * len(completion)] * len(prompts)}
        ).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client closed the connection


class StandInServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, completion, delay=0.0, hang_from=None, hang_seconds=600.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.completion, self.delay = completion, delay
        self.hang_from, self.hang_seconds = hang_from, hang_seconds
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.requests, self.in_flight = 0, 0
        self.guard = threading.Lock()
        self.received = threading.Condition(self.guard)
        self.release = threading.Event()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def wait_for_request(self, number, timeout=60):
        """Waits until the server has received its `number`-th request."""
        with self.received:
            return self.received.wait_for(lambda: self.requests >= number, timeout)

    def stop(self):
        self.release.set()
        self.shutdown()
        self.server_close()


class StandInClient:
    """The calls of TRL's `VLLMClient` that asynchronous rollouts make."""

    def __init__(self, base_url):
        self.base_url, self.session = base_url, requests.Session()

    def generate(self, prompts, max_tokens=16, **kwargs):
        response = self.session.post(f"{self.base_url}/v1/completions", json={"prompt": prompts}, timeout=600)
        response.raise_for_status()
        return response.json()


class StandInGeneration:
    """TRL's `VLLMGeneration` in server mode, against a [`StandInServer`] (`client=None` on a process that never talks
    to it). Counts the weight syncs, and those that arrived while the server was answering a request."""

    def __init__(self, client, server, max_completion_length):
        self.vllm_client, self.server = client, server
        self.repetition_penalty, self.temperature, self.top_p, self.top_k, self.min_p = 1.0, 1.0, 1.0, 0, 0.0
        self.max_completion_length = max_completion_length
        self.logprobs, self.structured_outputs_regex, self.generation_kwargs = 0, None, {}
        self.syncs, self.syncs_during_requests = 0, 0

    def sync_weights(self):
        if self.server is not None and self.server.in_flight:
            self.syncs_during_requests += 1
        self.syncs += 1

    def generate(self, prompts, images, num_generations):
        output = self.vllm_client.generate(prompts, self.max_completion_length)
        return prompts, output["completion_ids"], output["logprobs"], None


def use_stand_in(trainer, max_staleness=1, serve=True, **server_kwargs):
    """Switches `trainer` (built without vLLM) to asynchronous rollouts from a new [`StandInServer`] (with `serve`; a
    process that does not talk to the server passes `serve=False`), as `use_vllm=True, vllm_mode="server"` and
    `max_staleness` would, minus vLLM. Returns the server, or `None`."""
    tokenizer = trainer.processing_class
    completion = tokenizer("= 7", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    server = StandInServer(completion, **server_kwargs) if serve else None
    client = StandInClient(server.url) if serve else None
    trainer.args.max_staleness, trainer.args.use_vllm, trainer.args.vllm_mode = max_staleness, True, "server"
    trainer.use_vllm, trainer._last_loaded_step = True, -1
    trainer.vllm_generation = StandInGeneration(client, server, trainer.args.max_completion_length)
    return server
