"""A real python3 kernel (the kernelspec the Makefile installs into the venv), driven the way
JupyterLab drives one: execute requests on the shell channel, output read from iopub."""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class RealKernel:
    """A python3 kernel of its own, and cells run in it as JupyterLab sends them."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3", cwd=str(cwd), env={**os.environ, **env})

    def send(self, code: str, *, lab: bool = False) -> str:
        """Start running a cell; its message id. ``lab``: with JupyterLab's request metadata,
        which makes %ckpt_bench show the live lab."""
        content = {
            "code": code,
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        }
        msg = self.kc.session.msg("execute_request", content, metadata={"recordTiming": False} if lab else {})
        self.kc.shell_channel.send(msg)
        msg_id: str = msg["header"]["msg_id"]
        return msg_id

    def _messages(self, msg_id: str, timeout: float) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, content) of each iopub message of the cell ``msg_id``, up to its idle status."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.kc.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.01))
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            body = message["content"]
            if message["msg_type"] == "status" and body["execution_state"] == "idle":
                return
            yield message["msg_type"], body

    def output(
        self,
        msg_id: str,
        *,
        stream: str = "stdout",
        timeout: float = 180,
        until: Callable[[str], bool] | None = None,
    ) -> str:
        """What the cell ``msg_id`` writes to ``stream``, up to its idle status, or up to the
        moment ``until(output so far)`` holds (the cell goes on running then)."""
        out: list[str] = []
        for kind, body in self._messages(msg_id, timeout):
            if kind == "stream" and body["name"] == stream:
                out.append(body["text"])
                if until is not None and until("".join(out)):
                    break
        return "".join(out)

    def outputs(self, msg_id: str, timeout: float = 180) -> dict[str, str]:
        """Everything the cell ``msg_id`` shows up to its idle status: its ``stdout``, its
        ``stderr`` and the lines of its ``error`` (the traceback as the frontend shows it)."""
        shown = {"stdout": "", "stderr": "", "error": ""}
        for kind, body in self._messages(msg_id, timeout):
            if kind == "stream":
                shown[body["name"]] += body["text"]
            elif kind == "error":
                shown["error"] += "".join(line + "\n" for line in body["traceback"])
        return shown

    def reply(self, msg_id: str, timeout: float = 180) -> dict[str, Any]:
        """The execute reply's content of the cell ``msg_id``; after an error, once the kernel
        takes requests again."""
        content = self._reply(msg_id, timeout)
        if content["status"] == "error":
            self._settle(timeout)
        return content

    def _reply(self, msg_id: str, timeout: float) -> dict[str, Any]:
        while True:
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                content: dict[str, Any] = reply["content"]
                return content

    def _settle(self, timeout: float) -> None:
        """Wait until the kernel stops aborting what comes after a failed cell. ipykernel sets
        its abort flag once the error reply is out and clears it by a message its shell thread
        queues: a cell sent at once after that reply can overtake it on a busy machine and come
        back "aborted" (ipykernel#609), which no user clicking Run a moment later ever sees. A
        silent request runs no cell hooks; the first one not aborted says the flag is clear."""
        deadline = time.monotonic() + timeout
        while self._reply(self.kc.execute("", silent=True), timeout)["status"] == "aborted":
            assert time.monotonic() < deadline, "the kernel still aborts requests after an error"

    def run(self, code: str, *, lab: bool = False, timeout: float = 180, stream: str = "stdout") -> str:
        """Run a cell; return what it wrote to ``stream`` (it must succeed)."""
        msg_id = self.send(code, lab=lab)
        reply = self.reply(msg_id, timeout)
        out = self.output(msg_id, stream=stream, timeout=timeout)
        assert reply["status"] == "ok", (reply, out)
        return out

    def evaluate(self, expression: str, timeout: float = 60) -> str:
        """``repr`` of ``expression`` in the kernel, asked as a silent request: IPython runs no
        cell hooks for it (``pre_run_cell``/``post_run_cell``), so it changes nothing."""
        msg_id = self.kc.execute("", silent=True, user_expressions={"value": expression})
        value = self.reply(msg_id, timeout)["user_expressions"]["value"]
        assert value["status"] == "ok", value
        text: str = value["data"]["text/plain"]
        return text

    def drain(self) -> None:
        """Drop what iopub holds (a kernel restarted on the same ports sends its start-up there)."""
        while True:
            try:
                self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                return

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)
        else:  # ended by a signal: only its connection file and sockets are left
            self.km.cleanup_resources()
