"""`crucible dashboard`: the built-in page, opened in headless Chromium (Debian's, driven by Playwright),
draws every store panel of the shipped dashboards from a store holding a run's rows, refreshes live,
and its trajectory browser opens a task's group, a sample's transcript and its trace. Checked from
the DOM and from a screenshot's pixels."""
from __future__ import annotations

import datetime as dt
import io
import json
import shutil
import urllib.error
import urllib.request

import pytest
from PIL import Image

from crucible.cli.dashboard import serve, store_panels
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
