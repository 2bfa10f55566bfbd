"""A stand-in of `vllm serve`'s routes as vLLM 0.32's source has them, in a thread on loopback: the adapter routes
(entrypoints/serve/lora/api_router.py: they exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING; `--api-key` guards every
/v1 route with 401) and `/v1/completions` with token-id prompts, `n`, `logprobs: 0` and `return_token_ids`
(entrypoints/openai/completion: choices prompt by prompt, n each). Its completions are not a model's: tokens and
log-probs drawn from a seed of (model name, prompt, choice), so the same request always gets the same answer and two
versions' answers differ. Every completions request is recorded (`requests`: model, prompts, in arrival order), and
every completion answered (`answered`: its token ids -> the (model, prompt, choice) it answers).
What a stand-in cannot show, that a real server's completions come from the adapter just loaded, is the vLLM tier's
test (tests/vllm_engine/test_vllm_server.py)."""

import json
import random
import threading
import time
import zlib
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

KEY = "secret"


class StandIn(BaseHTTPRequestHandler):
    key, lora_routes, fail_load = KEY, True, False
    slow_after_loads, slow_s = None, 0.0  # once that many adapters were loaded, completions take slow_s seconds
    loaded: dict = {}  # a fresh dict per server (serve())
    requests: list = []
    loads: list = []  # every adapter loaded, in order: (name, folder)
    answered: dict = {}  # every completion answered: its token ids (a tuple) -> [(model, prompt token ids, choice)]
    vocab = (10, 200)  # token ids drawn from this range
    # the part of the adapter's name its answers are drawn by: all of it (two runs' versions answer apart); the
    # behaviour check (tests/behaviour.py) drops the run's own id so that two runs of one commit get the same answers
    seed_of = staticmethod(lambda model: model)

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, status: int, body: dict | None = None):
        data = json.dumps(body or {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") != f"Bearer {self.key}":
            self._reply(401, {"error": "Unauthorized"})
            return False
        return True

    def do_GET(self):
        if self._authorized():
            self._reply(200, {"data": [{"id": "base"}, *({"id": n} for n in self.loaded)]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self._authorized():
            return
        if self.path == "/v1/completions":
            return self._completions(body)
        if not self.lora_routes or self.path not in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            return self._reply(404, {"detail": "Not Found"})
        if "lora_name" not in body:
            return self._reply(422, {"detail": "field required"})
        if self.path == "/v1/load_lora_adapter":
            folder = Path(body["lora_path"])
            if self.fail_load or not (folder / "adapter_config.json").exists():
                return self._reply(404, {"error": {"message": f"No adapter found for {folder}"}})
            if body["lora_name"] in self.loaded and not body.get("load_inplace"):  # vLLM 0.32's serving_models.py
                return self._reply(400, {"error": {"message": f"The lora adapter '{body['lora_name']}' has already "
                                                   "been loaded. If you want to load the adapter in place, set "
                                                   "'load_inplace' to True."}})
            self.loaded[body["lora_name"]] = folder
            self.loads.append((body["lora_name"], folder))
        else:
            self.loaded.pop(body["lora_name"], None)
        self._reply(200)

    def _completions(self, body: dict):
        model, prompts, n, max_tokens = body["model"], body["prompt"], body.get("n", 1), body["max_tokens"]
        if model not in self.loaded:
            return self._reply(404, {"error": {"message": f"The model `{model}` does not exist."}})
        self.requests.append((model, [list(p) for p in prompts]))
        if self.slow_after_loads is not None and len(self.loads) >= self.slow_after_loads:
            time.sleep(self.slow_s)  # a server that stopped answering in time
        choices = []
        for prompt in prompts:
            for i in range(n):
                ids, logps = answer(self.seed_of(model), prompt, i, max_tokens, self.vocab)
                self.answered.setdefault(tuple(ids), []).append((model, list(prompt), i))
                length = len(ids)
                choices.append({"index": len(choices), "text": "", "token_ids": ids,
                                "logprobs": {"token_logprobs": logps},
                                "finish_reason": "length" if length == max_tokens else "stop"})
        self._reply(200, {"choices": choices})


def answer(model: str, prompt: list[int], choice: int, max_tokens: int, vocab=StandIn.vocab):
    """(token ids, log-probs) of the stand-in's `choice`-th completion of `prompt` by adapter `model`."""
    rng = random.Random(zlib.crc32(json.dumps([model, list(prompt), choice]).encode()))
    length = rng.randint(1, max_tokens)
    return [rng.randrange(*vocab) for _ in range(length)], [-rng.uniform(0.1, 3.0) for _ in range(length)]


@contextmanager
def serve(**attrs):
    """(base URL, handler class) of a fresh stand-in on a free loopback port; `attrs` override StandIn's."""
    handler = type("Handler", (StandIn,), {"loaded": {}, "requests": [], "loads": [], "answered": {}, **attrs})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    finally:
        srv.shutdown()
