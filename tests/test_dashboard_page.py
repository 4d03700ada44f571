"""`crucible dashboard`: the built-in page, opened in headless Chromium (Debian's, driven by Playwright),
draws every store panel of the shipped dashboards from a store holding a run's rows, refreshes live,
and its trajectory browser opens a task's group, a sample's transcript and its trace. Checked from
the DOM and from a screenshot's pixels."""
from __future__ import annotations

import datetime as dt
import http.client
import io
import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from PIL import Image

from crucible.cli import dashboard
from crucible.cli.dashboard import DashboardError, serve, store_panels
from tests.test_queries import filled  # noqa: F401  (the fixture: one episode group, a code sample, a step, ...)

pytestmark = [pytest.mark.store]
SERIES_BLUE = (0x15, 0x65, 0xC0)  # the first series' colour on the page


def fetch(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_api_runs_only_shipped_sql_and_says_what_is_wrong(filled):  # noqa: F811
    client, task, _ = filled
    server = serve(client, port=0)
    base = "http://127.0.0.1:%d" % server.server_address[1]
    try:
        status, panels = fetch(base + "/api/panels")
        assert status == 200 and [p["title"] for p in panels] == [p.title for p in store_panels()]
        assert fetch(base + "/api/panels/999")[0] == 404
        status, body = fetch(base + "/api/query/no-such-query")
        assert status == 400 and "saved queries are" in body["error"]
        status, body = fetch(base + "/api/query/task")  # its parameter is missing
        assert status == 400 and "--task" in body["error"]
        # a parameter is a bound value, never SQL
        status, body = fetch(base + "/api/query/task?task=" + urllib.request.quote("x' OR 1=1 --"))
        assert status == 200 and body["rows"] == []
        status, body = fetch(base + "/api/query/task?task=" + urllib.request.quote(task.id))
        assert status == 200 and len(body["rows"]) == 2
    finally:
        server.shutdown()


def get_as(port: int, path: str, host: str) -> tuple[int, dict]:
    """A GET whose Host header says `host` (what a browser sends for the name in its address bar)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Host": host})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` (a read sees the end) within `within_s` seconds."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def test_a_request_addressed_to_another_host_is_refused():
    """A DNS-rebinding page reaches the dashboard under the attacker's name: it must not read the rows."""
    server = serve(None, port=0)
    port = server.server_address[1]
    try:
        for foreign in ["attacker.example", f"attacker.example:{port}", f"localhost.attacker.example:{port}"]:
            status, body = get_as(port, "/api/panels", foreign)
            assert status == 403 and list(body) == ["error"] and "not this dashboard" in body["error"], (foreign, body)
        for ours in ["localhost", f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.1", f"[::1]:{port}"]:
            status, body = get_as(port, "/api/panels", ours)
            assert status == 200 and [p["title"] for p in body] == [p.title for p in store_panels()], ours
    finally:
        server.shutdown()


def test_an_idle_connection_is_closed_and_connections_are_capped(monkeypatch):
    """A half-sent request does not hold a thread for ever, and idle clients cannot take every thread."""
    monkeypatch.setattr(dashboard, "IDLE_TIMEOUT_S", 0.5)
    server = serve(None, port=0)
    address = server.server_address[:2]
    try:
        with socket.create_connection(address) as half_sent:
            half_sent.sendall(b"GET /api/pan")
            start = time.monotonic()
            assert closed_by_server(half_sent, 5), "the server held a half-sent request for 5 s"
            assert time.monotonic() - start >= 0.4
    finally:
        server.shutdown()

    monkeypatch.setattr(dashboard, "IDLE_TIMEOUT_S", 30)
    monkeypatch.setattr(dashboard, "MAX_CONNECTIONS", 2)
    server = serve(None, port=0)
    address = server.server_address[:2]
    try:
        idle = [socket.create_connection(address) for _ in range(2)]
        for sock in idle:
            sock.sendall(b"GET /api/pan")
        with socket.create_connection(address) as one_too_many:
            assert closed_by_server(one_too_many, 5), "a connection past the cap was kept"
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 5  # their threads see the close and give their slots back
        while True:
            try:
                assert get_as(address[1], "/api/panels", "localhost")[0] == 200
                break
            except ConnectionError:  # closed at once: a slot is not free yet
                assert time.monotonic() < deadline, "the closed connections' slots were not given back"
                time.sleep(0.05)
    finally:
        server.shutdown()


def test_a_panel_id_or_a_parameter_the_api_does_not_take_is_refused(filled):  # noqa: F811
    client, task, _ = filled
    server = serve(client, port=0)
    port = server.server_address[1]
    try:
        # '²' passes str.isdigit(); a raw Latin-1 byte in the request line reaches the handler as it
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /api/panels/\xb2 HTTP/1.0\r\nHost: localhost\r\n\r\n")
            sock.settimeout(10)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.0 404 "), reply[:200]
        assert get_as(port, "/api/panels/01", "localhost")[0] == 404
        # a filter dropped in silence would show every run's rows as one run's: `crucible query` refuses it too
        status, body = get_as(port, "/api/query/alerts?run=x", "localhost")
        assert status == 400 and "--run" in body["error"] and "no parameters" in body["error"], body
        status, body = get_as(port, f"/api/query/task?task={task.id}&trajectory=y", "localhost")
        assert status == 400 and "--trajectory" in body["error"], body
        assert get_as(port, "/api/query/alerts", "localhost")[0] == 200
    finally:
        server.shutdown()


def test_flags_the_dashboard_cannot_serve_with_are_named():
    for refresh in [float("nan"), float("inf"), 0, -1, 0.1]:
        with pytest.raises(DashboardError, match=f"^--refresh {refresh:g}: "):
            serve(None, port=0, refresh_s=refresh)
    with pytest.raises(DashboardError, match="^--port 70000: "):
        serve(None, port=70000)
    with pytest.raises(DashboardError, match="^--host no.such.host.invalid: "):
        serve(None, host="no.such.host.invalid", port=0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(DashboardError, match=f"^--port {taken.getsockname()[1]}: .*in use"):
            serve(None, port=taken.getsockname()[1])


@pytest.mark.timeout(120)
async def test_the_page_draws_every_panel_live_and_browses_a_trajectory_in_chromium(filled, tmp_path):  # noqa: F811
    from playwright.async_api import async_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing (`crucible test` installs it: apt-get install chromium)"
    client, task, trajectories = filled
    refresh_s = 0.5
    server = serve(client, port=0, refresh_s=refresh_s)
    url = "http://127.0.0.1:%d/" % server.server_address[1]
    errors: list[str] = []
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--headless=new"])
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(url)
            await page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            drawn = await page.eval_on_selector_all(
                "section[data-type]", "els => els.map(e => [e.dataset.panel, +(e.dataset.rows || 0), "
                "e.querySelectorAll('path.series, circle, rect.bar, td').length, !!e.querySelector('.error')])")
            assert [d[0] for d in drawn] == [p.title for p in store_panels()]
            for title, rows, marks, failed in drawn:
                assert rows > 0 and marks > 0 and not failed, (title, rows, marks)

            # live: a new step appears without reloading
            curve = "section[data-panel^='Learning curve']"
            before = int(await page.get_attribute(curve, "data-rows"))
            client.insert("train_steps", [["run-1", 2, 2, 0.1, 0.02, 1.0, 0.5, 0.75, 0.75, 1e-4, 10.0,
                                           dt.datetime.now(dt.timezone.utc)]],
                          column_names=["run_id", "step", "policy_version", "loss", "kl", "entropy", "grad_norm",
                                        "reward_mean", "pass_rate", "lr", "step_time_ms", "ts"])
            await page.wait_for_function(f"+document.querySelector(\"{curve}\").dataset.rows > {before}",
                                         timeout=15_000)

            # a panel whose rows did not change is not drawn again: the link a user is about to click
            # is still the same element after several refreshes (a link redrawn between a click's press
            # and release gets no click: the likely cause of one CI run waiting 30 s here for the group)
            link = f"a[data-open='task'][data-id='{task.id}']"
            await page.eval_on_selector(link, "a => { a.dataset.marked = '1'; }")
            await page.wait_for_timeout(4 * refresh_s * 1000)  # four refreshes
            assert await page.eval_on_selector(link, "a => a.dataset.marked === '1'"), "an unchanged panel was redrawn"

            # the trajectory browser: a task from the trajectories table, then one sample of its group
            await page.click(link)
            await page.wait_for_selector("#group table")
            group_rows = await page.eval_on_selector_all("#group tr", "rs => rs.length - 1")
            assert group_rows == len([t for t in trajectories if t.task_id == task.id])
            solved = next(t for t in trajectories if t.turns == 2)
            await page.click(f"#group a[data-open='trajectory'][data-id='{solved.id}']")
            await page.wait_for_selector("#episode table")
            await page.wait_for_selector("#trace table")
            transcript = await page.inner_text("#episode")
            assert "lookup" in transcript
            assert await page.eval_on_selector_all("#trace tr", "rs => rs.length - 1") == 2  # parent and score

            shot = await page.screenshot(full_page=True)
            (tmp_path / "dashboard.png").write_bytes(shot)
            await browser.close()
    finally:
        server.shutdown()
    assert errors == []
    image = Image.open(io.BytesIO(shot)).convert("RGB")
    assert image.width == 1280 and image.height > 900
    colours = image.getcolors(maxcolors=1 << 20)
    assert len(colours) > 50, "the screenshot is nearly blank"
    # the charts' lines are there in pixels, not only in the DOM
    blue = sum(n for n, rgb in colours if all(abs(a - b) <= 24 for a, b in zip(rgb, SERIES_BLUE)))
    assert blue > 200, blue


@pytest.mark.timeout(120)
def test_crucible_dashboard_serves_the_page_from_the_configured_store(stack_settings, filled, tmp_path):  # noqa: F811
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "CRUCIBLE_HOME": str(tmp_path), "CRUCIBLE_CLICKHOUSE_URL": stack_settings.clickhouse_url,
           "CRUCIBLE_CLICKHOUSE_DATABASE": stack_settings.clickhouse_database}
    proc = subprocess.Popen([sys.executable, "-m", "crucible.cli.main", "dashboard", "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "dashboard on http://" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "crucible dashboard exited"
        url = line.split("dashboard on ")[1].split()[0]
        with urllib.request.urlopen(url, timeout=10) as r:
            assert b"Trajectory browser" in r.read()
        status, body = fetch(url + "api/panels/0")
        assert status == 200 and body["rows"], body
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.timeout(120)
def test_crucible_dashboard_refuses_a_bad_refresh_in_one_line(stack_settings, tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "CRUCIBLE_HOME": str(tmp_path), "CRUCIBLE_CLICKHOUSE_URL": stack_settings.clickhouse_url,
           "CRUCIBLE_CLICKHOUSE_DATABASE": stack_settings.clickhouse_database}
    proc = subprocess.Popen([sys.executable, "-m", "crucible.cli.main", "dashboard", "--port", "0", "--refresh", "nan"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"crucible dashboard --refresh nan served: {out}")
    assert proc.returncode != 0 and out.strip().splitlines() == [out.strip()] and "--refresh nan" in out, out


def test_a_request_head_trickled_in_is_cut_off_and_a_client_that_hangs_up_is_no_error(monkeypatch, capsys):
    """A byte every few seconds passed the per-read timeout for as long as the client liked, holding a
    thread, and with the cap every one; a client hanging up mid-answer printed a traceback each time.
    The store, the dashboard and every service's /metrics share this server (shared/http_server.py)."""
    from crucible.shared import http_server

    monkeypatch.setattr(http_server, "HEAD_DEADLINE_S", 1.5)
    monkeypatch.setattr(dashboard, "IDLE_TIMEOUT_S", 30)
    server = serve(None, port=0)
    address = server.server_address[:2]
    try:
        with socket.create_connection(address) as slow:
            start = time.monotonic()
            closed = False
            for byte in b"GET /api/panels HTTP/1.1\r\nHost: localhost\r\n":
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed = True
                    break
                time.sleep(0.25)
                if time.monotonic() - start > 6:
                    break
            assert closed or closed_by_server(slow, 3), "a request head trickled in for 6 s was kept"
            assert time.monotonic() - start < 8
        assert get_as(address[1], "/api/panels", "localhost")[0] == 200
    finally:
        server.shutdown()

    # /metrics: capped like the others (it is served on every interface in k8s and compose)
    class Gone(http_server.RequestHandler):
        def do_GET(self):  # noqa: N802
            raise BrokenPipeError(32, "Broken pipe")

    gone = http_server.BoundedThreadingHTTPServer(("127.0.0.1", 0), Gone, 4)
    threading.Thread(target=gone.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(gone.server_address[:2]) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            closed_by_server(sock, 5)
        time.sleep(0.2)
        assert "Traceback" not in capsys.readouterr().err
    finally:
        gone.shutdown()


def test_a_services_metrics_endpoint_takes_so_many_connections_and_no_more():
    """It was a thread per connection without a cap, on every interface in k8s and compose."""
    import subprocess
    import sys

    from crucible.shared import metrics

    code = ("import sys, time; from crucible.shared import metrics; from crucible.shared.settings import Settings; "
            "print(metrics.setup_metrics('probe', Settings(metrics_host='127.0.0.1', metrics_port=0)), flush=True); "
            "time.sleep(60)")
    probe = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(probe.stdout.readline())
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(metrics.METRICS_CONNECTIONS)]
        for sock in idle:
            sock.sendall(b"GET /metr")
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port)) as one_too_many:
            assert closed_by_server(one_too_many, 5), "a connection past the cap was kept"
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 5
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                    assert reply.status == 200
                break
            except (ConnectionError, urllib.error.URLError, http.client.HTTPException):
                assert time.monotonic() < deadline, "the closed connections' slots were not given back"
                time.sleep(0.05)
    finally:
        probe.kill()
        probe.wait()
