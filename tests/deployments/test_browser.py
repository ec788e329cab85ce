"""The web page in a real browser (Debian's headless Chromium driven by Playwright): it starts a session,
the <video> plays the fMP4 stream through Media Source Extensions, and a key press reaches the server. The
page works under the ingress's Content-Security-Policy: the browser reports no violation of it."""
import asyncio
import math
import shutil

from tests.deployments.conftest import HTTP

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--autoplay-policy=no-user-gesture-required"]


async def open_page(playwright, path: str = "/", browser=None):
    """Headless Chromium (a new one, or another page of `browser`) on the app's page (at `path`), once it has loaded
    the served config. Wait predicates are functions ("() => ..."): Playwright evaluates a bare expression with
    eval, which the page's CSP forbids."""
    if browser is None:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS,
                                                   ignore_default_args=["--headless"])
    page = await browser.new_page()
    await page.add_init_script("window.cspViolations = []; document.addEventListener('securitypolicyviolation', "
                               "e => window.cspViolations.push(e.violatedDirective + ' ' + e.blockedURI));")
    await page.goto(f"{HTTP}{path}")
    await page.wait_for_function("() => window.lingbot.config !== null", timeout=30000)
    return browser, page


def test_page_plays_and_sends_keys(serve_app, tmp_path):
    from playwright.async_api import async_playwright

    async def scenario():
        async with async_playwright() as p:
            browser, page = await open_page(p)
            await page.fill("#chunks", "8")
            await page.click("#start")
            await page.wait_for_function("() => window.lingbot.chunks >= 2", timeout=90000)
            t_before = await page.evaluate("document.getElementById('video').currentTime")
            await page.keyboard.down("d")
            await page.wait_for_function("() => window.lingbot.acks >= 1", timeout=30000)
            await page.keyboard.up("d")
            await page.wait_for_function("() => window.lingbot.startedEvents.includes('ui-1')", timeout=90000)
            # the page measures the press's control -> display latency once its chunk is on screen
            await page.wait_for_function("() => window.lingbot.controlLatencies.length >= 1", timeout=90000)
            control = await page.evaluate("[window.lingbot.controlLatencies.slice(), "
                                          "document.getElementById('s-control').textContent, "
                                          "document.getElementById('s-quality').textContent]")
            await page.wait_for_function("() => window.lingbot.chunks >= 6", timeout=90000)
            await asyncio.sleep(1.0)
            info = await page.evaluate("""() => { const v = document.getElementById('video');
                return {time: v.currentTime, frames: v.getVideoPlaybackQuality().totalVideoFrames,
                        errors: window.lingbot.errors, mediaError: v.error && v.error.code, csp: window.cspViolations,
                        buffered: v.buffered.length ? v.buffered.end(v.buffered.length - 1) : 0}; }""")
            await page.screenshot(path=str(tmp_path / "page.png"))
            await browser.close()
            return t_before, info, control

    t_before, info, control = asyncio.run(scenario())
    latencies, shown, quality = control
    assert quality == "full"                       # the chunk's rung, as its metadata names it (the ladder is off)
    recent = sorted(latencies[-8:])
    assert all(ms > 0 for ms in latencies)
    assert shown == f"{math.floor(recent[(len(recent) - 1) // 2] + 0.5)} ms"     # their median (JS Math.round)
    assert info["errors"] == [] and info["mediaError"] is None and info["csp"] == []
    assert info["time"] > t_before and info["time"] > 0.5          # playback advanced
    assert info["frames"] >= 20                                     # frames were decoded
    assert info["buffered"] >= (9 + 12 * 4) / 16 - 0.1              # the chunks were appended as they came


def test_page_draws_the_servers_raw_frames_on_a_canvas(serve_app):
    """The canvas transport speaks the second protocol from the page (its own MessagePack codec): the frame it
    draws last is, pixel for pixel, the last raw frame a Python client gets for the same inputs; held keys go
    out as key state and their control -> display latency is measured. A key in the page's URL moves to its key
    field and out of the URL, and goes out as a subprotocol (the server answers `lingbot`, or Chromium would
    drop the connection); the page encodes it as the door decodes it."""
    import numpy as np
    from playwright.async_api import async_playwright

    from deployments.client import FramesClient
    from deployments.ingress.access import subprotocol_key
    from tests.deployments.clients import frames_url

    async def scenario():
        async with async_playwright() as p:
            browser, page = await open_page(p, "/?api_key=%C3%A9%3F%3E%3F~%3F&view=1")
            key = await page.evaluate("() => [location.search, document.getElementById('api-key').value, "
                                      "window.lingbot.keySubprotocols(document.getElementById('api-key').value)]")
            await page.select_option("#transport", "frames")
            await page.fill("#chunks", "3")
            await page.click("#start")
            await page.wait_for_function("() => window.lingbot.framesDrawn >= 33 && !window.lingbot.running",
                                         timeout=90000)
            drawn = await page.evaluate("""() => { const c = document.getElementById('canvas');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                const rgb = []; for (let i = 0; i < d.length; i += 4) rgb.push(d[i], d[i + 1], d[i + 2]);
                return {rgb, w: c.width, h: c.height, image: window.lingbot.imageUrl, errors: window.lingbot.errors,
                        status: document.getElementById('status').textContent,
                        quality: document.getElementById('s-quality').textContent,
                        prompt: document.getElementById('prompt').value, csp: window.cspViolations}; }""")
            await page.fill("#chunks", "8")
            await page.click("#start")
            await page.wait_for_function("() => window.lingbot.framesDrawn >= 12", timeout=90000)
            await page.keyboard.down("d")
            await page.wait_for_function("() => window.lingbot.acks >= 1", timeout=90000)
            await page.keyboard.up("d")
            await page.wait_for_function("() => window.lingbot.controlLatencies.length >= 1", timeout=90000)
            await page.wait_for_function("() => !window.lingbot.running && window.lingbot.frames.length === 0",
                                         timeout=90000)
            keys = await page.evaluate("[window.lingbot.controlLatencies, window.lingbot.errors, "
                                       "window.lingbot.framesDrawn, window.lingbot.startedEvents]")
            await browser.close()
        async with FramesClient(frames_url(serve_app)) as client:
            await client.init(drawn["prompt"], drawn["image"], 3, 0)
            python = await client.receive_session()
        return drawn, keys, python, key

    drawn, keys, python, key = asyncio.run(scenario())
    assert key == ["?view=1", "é?>?~?", ["lingbot", "lingbot-key.w6k_Pj9-Pw"]]    # standard base64: w6k/Pj9+Pw==
    assert subprotocol_key({"sec-websocket-protocol": ", ".join(key[2])}) == "é?>?~?"
    assert drawn["errors"] == [] and drawn["status"] == "done: 3 chunks (generation complete)"
    assert drawn["quality"] == "full"                    # from the chunks' chunk_stats
    assert drawn["csp"] == []
    canvas = np.array(drawn["rgb"], np.uint8).reshape(drawn["h"], drawn["w"], 3)
    assert python.frames.shape[0] == 33 and np.array_equal(canvas, python.frames[-1])
    latencies, errors, frames, started = keys
    assert errors == [] and frames == 93 and started[:1] == [1]
    assert all(ms > 0 for ms in latencies)


async def playing(playwright, chunks: int):
    """A new browser on the page, playing an endless session of its own (H.264) once `chunks` chunks came."""
    browser, page = await open_page(playwright)
    await page.check("#endless")
    await page.click("#start")
    await page.wait_for_function(f"() => window.lingbot.chunks >= {chunks}", timeout=90000)
    return browser, page


def test_a_shared_session_plays_on_two_viewer_pages(serve_app):
    """The owner's page starts an endless session and shares it (the button): the watch link appears; two pages
    opened with it play the session watch-only (no controls shown), their first fragment starts with a keyframe,
    and the owner's page shows 2 viewers. The owner stops: both viewers are told the session ended."""
    from playwright.async_api import async_playwright

    from lingbot.io.video import fragment_starts_with_keyframe

    async def scenario():
        async with async_playwright() as p:
            browser, owner = await playing(p, 1)
            await owner.click("#share")
            await owner.wait_for_function("() => window.lingbot.sharing.link !== ''", timeout=30000)
            link = await owner.evaluate("() => window.lingbot.sharing.link")
            viewers = [(await open_page(p, link.removeprefix(HTTP), browser))[1] for _ in range(2)]
            await owner.wait_for_function("() => document.getElementById('s-viewers').textContent === '2'",
                                          timeout=60000)
            seen = []
            for viewer in viewers:
                await viewer.wait_for_function("() => window.lingbot.sharing.fragments >= 3 && "
                                               "document.getElementById('video').currentTime > 0.3", timeout=90000)
                seen.append(await viewer.evaluate("""() => ({first: window.lingbot.sharing.firstFragment,
                    controls: getComputedStyle(document.getElementById('owner-controls')).display,
                    frames: document.getElementById('video').getVideoPlaybackQuality().totalVideoFrames,
                    errors: window.lingbot.errors, csp: window.cspViolations})"""))
            await owner.click("#stop")
            for viewer in viewers:
                await viewer.wait_for_function("() => document.getElementById('status').textContent"
                                               ".startsWith('the session ended')", timeout=60000)
            owned = await owner.evaluate("() => ({errors: window.lingbot.errors, csp: window.cspViolations})")
            await browser.close()
            return link, seen, owned

    link, seen, owned = asyncio.run(scenario())
    assert link.startswith(f"{HTTP}/?watch=") and len(link.partition("=")[2]) == 40     # a tag, 192 bits base64url
    assert owned == {"errors": [], "csp": []}
    for viewer in seen:
        assert viewer["errors"] == [] and viewer["csp"] == [] and viewer["controls"] == "none"
        assert fragment_starts_with_keyframe(bytes(viewer["first"]))
        assert viewer["frames"] >= 1


def test_a_world_saved_on_the_page_is_listed_with_its_first_frame_and_resumes(serve_app):
    """The page's Save button keeps the playing session's world; the world appears in the page's list with its
    first frame (a thumbnail loaded), and its Resume button starts a session from it that plays (the server tells
    the page the world's chunks were replayed)."""
    from playwright.async_api import async_playwright

    async def scenario():
        async with async_playwright() as p:
            browser, page = await playing(p, 2)
            await page.click("#save")
            await page.wait_for_function("() => window.lingbot.worlds.saved.length === 1", timeout=30000)
            saved = await page.evaluate("() => window.lingbot.worlds.saved[0]")
            await page.click("#stop")
            await page.wait_for_function("() => !window.lingbot.running", timeout=60000)
            resume = f"button[data-world='{saved['world_id']}']"
            await page.wait_for_selector(resume, timeout=30000)
            await page.wait_for_function("() => window.lingbot.worlds.thumbnails >= 1", timeout=30000)
            await page.uncheck("#endless")
            await page.fill("#chunks", "3")
            await page.click(resume)
            await page.wait_for_function("() => window.lingbot.worlds.resumed !== null && window.lingbot.chunks >= 2 "
                                         "&& document.getElementById('video').currentTime > 0.3", timeout=120000)
            seen = await page.evaluate("""() => ({resumed: window.lingbot.worlds.resumed, errors: window.lingbot.errors,
                csp: window.cspViolations, listed: window.lingbot.worlds.list.map((w) => w.id)})""")
            await browser.close()
            return saved, seen

    saved, seen = asyncio.run(scenario())
    assert seen["errors"] == [] and seen["csp"] == []
    assert saved["world_id"] in seen["listed"] and saved["chunk_index"] >= 1
    assert seen["resumed"]["reason"] == "saved"
    assert seen["resumed"]["restored_chunks"] + seen["resumed"]["replayed_chunks"] == saved["chunk_index"] + 1
