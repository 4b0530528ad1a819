"""``kairos chaos`` reads the ingress's in-flight count from ``/health``, over real HTTP, whatever answers."""

import asyncio
import http.server
import threading

import pytest

from kairos_ray.bench.chaos import health_in_flight

ANSWERS = {  # path -> (status, content type, body)
    "/ok/health": (200, "application/json", b'{"status": "ok", "in_flight": 3}'),
    "/replacing/health": (503, "text/plain", b"Service Unavailable"),
    "/odd/health": (200, "application/json", b'{"status": "ok"}'),
}


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        status, kind, body = ANSWERS[self.path]
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_the_count_when_the_ingress_answers(server):
    assert asyncio.run(health_in_flight(f"{server}/ok")) == 3


@pytest.mark.parametrize("app", ["replacing", "odd"])
def test_no_count_and_what_came_said_when_the_answer_carries_none(server, app, capsys):
    assert asyncio.run(health_in_flight(f"{server}/{app}")) is None
    said = capsys.readouterr().err
    assert "/health gave no in-flight count" in said and ("503" in said if app == "replacing" else "200" in said)


def test_no_count_when_nothing_answers():
    assert asyncio.run(health_in_flight("http://127.0.0.1:9")) is None


def test_the_view_is_not_whole_while_the_router_cannot_be_read(monkeypatch):
    from ray.exceptions import ActorDiedError

    from kairos_ray.bench.chaos import Chaos

    chaos = object.__new__(Chaos)  # no app: only the view's reading is under test

    def dead():
        raise ActorDiedError()

    monkeypatch.setattr(chaos, "states", dead)
    assert chaos.whole() is False  # the router-kill fault's moment: not whole, and no crash of the tool
