// lingbot-serve web page: start a session over WS /v1/realtime/video and play the fMP4 chunks through
// Media Source Extensions as they arrive, or over WS /v1/realtime_video/generate (MessagePack) and draw the
// raw frames on a canvas at the session's frame rate; steer with W/A/S/D + I/J/K/L (arrows too) or the buttons.
"use strict";

const $ = (id) => document.getElementById(id);
const KEYS = new Set(["w", "a", "s", "d", "i", "j", "k", "l"]);
const ARROWS = { ArrowUp: "w", ArrowDown: "s", ArrowLeft: "j", ArrowRight: "l" };

const state = {
  config: null, ws: null, imageUrl: null, mediaSource: null, sourceBuffer: null, queue: [],
  startedAt: 0, firstChunkAt: 0, lastChunkAt: 0, intervals: [], chunks: 0, videoSeconds: 0,
  held: new Set(), eventSeq: 0, acks: 0, lastSentKeys: "", running: false, startedEvents: [], errors: [],
  sentAt: {}, pendingShows: [], controlLatencies: [],
  transport: "mse", frames: [], framesReceived: 0, framesDrawn: 0, nextFrameAt: 0, echoed: null, lastFrame: null,
};
window.lingbot = state;   // for tests and curious people

function log(text) {
  const el = $("log");
  el.textContent += `${new Date().toLocaleTimeString()}  ${text}\n`;
  el.scrollTop = el.scrollHeight;
}

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function showQueued(msg) {
  // the session waits for a model group (all full, or one still starting): its place and the estimate
  const eta = msg.eta_s == null ? "" : `, about ${Math.ceil(msg.eta_s)} s`;
  setStatus(`waiting for a model group: place ${msg.position} in the queue${eta}`);
  log(`queued: place ${msg.position}${eta}`);
}

async function loadConfig() {
  const r = await fetch("/v1/config");
  state.config = await r.json();
  $("served").textContent = `${state.config.preset} · ${state.config.width}x${state.config.height} · ` +
                            `${state.config.fps} fps · SP-${state.config.sp}`;
  $("random-weights").style.display = state.config.random_weights ? "block" : "none";
  $("chunks").value = state.config.default_chunks;
  if (!state.imageUrl) state.imageUrl = defaultImage(state.config.width, state.config.height);
}

function defaultImage(w, h) {
  // A generated first frame (sky, ground, a path), so the page works without choosing a file.
  const c = document.createElement("canvas");
  c.width = w; c.height = h;
  const g = c.getContext("2d");
  const sky = g.createLinearGradient(0, 0, 0, h / 2);
  sky.addColorStop(0, "#6fa8ff"); sky.addColorStop(1, "#cfe3ff");
  g.fillStyle = sky; g.fillRect(0, 0, w, h / 2);
  g.fillStyle = "#3f7a3a"; g.fillRect(0, h / 2, w, h / 2);
  g.fillStyle = "#a08060";
  g.beginPath(); g.moveTo(w * 0.45, h / 2); g.lineTo(w * 0.55, h / 2); g.lineTo(w * 0.8, h); g.lineTo(w * 0.2, h);
  g.fill();
  return c.toDataURL("image/png");
}

$("image").addEventListener("change", () => {
  const file = $("image").files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => {
    state.imageUrl = reader.result;
    $("preview").src = reader.result;
    $("preview").style.display = "block";
  };
  reader.readAsDataURL(file);
});

function resetStats() {
  Object.assign(state, { startedAt: performance.now(), firstChunkAt: 0, lastChunkAt: 0, intervals: [], chunks: 0,
                         videoSeconds: 0, acks: 0, queue: [] });
  Object.assign(state, { sentAt: {}, pendingShows: [], controlLatencies: [] });
  Object.assign(state, { frames: [], framesReceived: 0, framesDrawn: 0, nextFrameAt: 0, echoed: null, lastFrame: null,
                         lastSentKeys: "" });
  for (const id of ["s-interval", "s-rtf", "s-buffer", "s-ttfc", "s-control", "s-quality"]) $(id).textContent = "–";
  $("s-chunks").textContent = "0"; $("s-acks").textContent = "0";
}

function appendNext() {
  const sb = state.sourceBuffer;
  if (!sb || sb.updating || state.queue.length === 0) return;
  sb.appendBuffer(state.queue.shift());
}

function setupMedia(mime) {
  if (!window.MediaSource || !MediaSource.isTypeSupported(mime)) {
    setStatus(`this browser cannot play ${mime}`, true);
    return false;
  }
  const ms = new MediaSource();
  state.mediaSource = ms;
  $("video").src = URL.createObjectURL(ms);
  ms.addEventListener("sourceopen", () => {
    state.sourceBuffer = ms.addSourceBuffer(mime);
    state.sourceBuffer.mode = "segments";
    state.sourceBuffer.addEventListener("updateend", () => {
      appendNext();
      const v = $("video");
      if (v.paused && v.buffered.length) v.play().catch(() => {});
    });
    appendNext();
  });
  return true;
}

function onChunk(meta, data) {
  const now = performance.now();
  state.chunks += 1;
  if (!state.firstChunkAt) {
    state.firstChunkAt = now;
    $("s-ttfc").textContent = `${((now - state.startedAt) / 1000).toFixed(2)} s`;
  } else {
    state.intervals.push(now - state.lastChunkAt);
    const recent = state.intervals.slice(-8);
    $("s-interval").textContent = `${(recent.reduce((a, b) => a + b, 0) / recent.length / 1000).toFixed(2)} s`;
  }
  state.lastChunkAt = now;
  // control -> display: this chunk starts at media time videoSeconds; the events it started show then
  for (const id of meta.started_event_ids) {
    if (id in state.sentAt) state.pendingShows.push({ id, sentAt: state.sentAt[id], mediaTime: state.videoSeconds });
  }
  state.videoSeconds += meta.num_frames / state.config.fps;
  if (meta.quality) $("s-quality").textContent = meta.quality;
  if (data === null) {                               // the canvas transport counts its frames itself
    $("s-chunks").textContent = state.chunks;
    return;
  }
  $("s-rtf").textContent = (((now - state.firstChunkAt) / 1000 + 1e-9) /
                            Math.max(state.videoSeconds - meta.num_frames / state.config.fps, 1e-9)).toFixed(2);
  $("s-chunks").textContent = state.chunks;
  state.queue.push(data);
  appendNext();
  state.startedEvents.push(...meta.started_event_ids);
  if (meta.started_event_ids.length) log(`chunk ${meta.generation_chunk_index}: started ${meta.started_event_ids.join(", ")}`);
  sendHeldKeys();
}

function sendInteraction(event) {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN || !state.running) return;
  const id = `ui-${++state.eventSeq}`;
  state.sentAt[id] = performance.now();
  state.ws.send(JSON.stringify({ type: "session.interaction", interaction: { event_id: id, event } }));
  return id;
}

function heldKeys() {
  return [...state.held].sort().join("");
}

function sendHeldKeys() {
  // Held keys drive the next chunk (one key set per latent frame); a release sends one empty set.
  const keys = heldKeys();
  $("s-keys").textContent = keys || "–";
  if (state.transport === "frames") {
    // key state: the server holds the level across chunks, and shows a tap for at least one latent frame
    if (keys === state.lastSentKeys || !state.ws || state.ws.readyState !== WebSocket.OPEN || !state.running) return;
    const id = ++state.eventSeq;
    state.sentAt[id] = performance.now();
    state.ws.send(MsgPack.encode({ type: "event", kind: "camera_actions", event_id: id, payload: {
      mode: "state", transitions: [{ actions: [...keys], client_ts_ms: Date.now() }] } }));
    state.lastSentKeys = keys;
    return;
  }
  if (!keys && !state.lastSentKeys) return;
  sendInteraction({ keys: [keys, keys, keys] });
  state.lastSentKeys = keys;
}

function press(key, down) {
  if (!KEYS.has(key) || (state.sharing && state.sharing.watching)) return;     // a viewer only watches
  const had = state.held.has(key);
  if (down) state.held.add(key); else state.held.delete(key);
  document.querySelectorAll(`[data-key="${key}"]`).forEach((b) => b.classList.toggle("held", down));
  if (had !== down) sendHeldKeys();
}

document.addEventListener("keydown", (e) => {
  if (e.target.tagName === "TEXTAREA" || e.target.tagName === "INPUT") return;
  const key = ARROWS[e.key] || e.key.toLowerCase();
  if (KEYS.has(key)) { e.preventDefault(); press(key, true); }
});
document.addEventListener("keyup", (e) => {
  const key = ARROWS[e.key] || e.key.toLowerCase();
  if (KEYS.has(key)) press(key, false);
});
document.querySelectorAll("[data-key]").forEach((b) => {
  b.addEventListener("pointerdown", () => press(b.dataset.key, true));
  b.addEventListener("pointerup", () => press(b.dataset.key, false));
  b.addEventListener("pointerleave", () => press(b.dataset.key, false));
});

function watchControls() {
  // each frame: an event whose chunk's first frame is now on screen has its control -> display latency
  const v = $("video");
  const shown = state.pendingShows.filter((p) => v.currentTime >= p.mediaTime);
  if (shown.length) {
    const now = performance.now();
    state.pendingShows = state.pendingShows.filter((p) => v.currentTime < p.mediaTime);
    for (const p of shown) state.controlLatencies.push(now - p.sentAt);
    const recent = state.controlLatencies.slice(-8).sort((a, b) => a - b);
    $("s-control").textContent = `${Math.round(recent[Math.floor((recent.length - 1) / 2)])} ms`;
  }
  requestAnimationFrame(watchControls);
}
requestAnimationFrame(watchControls);

function drawFrames() {
  // the canvas player: frame i is due 1/fps after frame i-1; when none is queued in time, playback waits
  const now = performance.now();
  let frame = null;
  while (state.frames.length && now >= state.nextFrameAt) {
    frame = state.frames.shift();
    state.nextFrameAt = Math.max(state.nextFrameAt, now - 1000 / state.config.fps) + 1000 / state.config.fps;
    state.framesDrawn += 1;
  }
  if (frame) {
    const c = $("canvas"), g = c.getContext("2d");
    const image = g.createImageData(frame.width, frame.height);
    const rgb = frame.rgb, rgba = image.data;
    for (let i = 0, j = 0; i < rgb.length; i += 3, j += 4) {
      rgba[j] = rgb[i]; rgba[j + 1] = rgb[i + 1]; rgba[j + 2] = rgb[i + 2]; rgba[j + 3] = 255;
    }
    if (c.width !== frame.width || c.height !== frame.height) { c.width = frame.width; c.height = frame.height; }
    g.putImageData(image, 0, 0);
    state.lastFrame = rgb;
    $("s-frames").textContent = state.framesDrawn;
    const shown = state.pendingShows.filter((p) => state.framesDrawn > p.frame);
    if (shown.length) {
      state.pendingShows = state.pendingShows.filter((p) => state.framesDrawn <= p.frame);
      for (const p of shown) state.controlLatencies.push(now - p.sentAt);
      const recent = state.controlLatencies.slice(-8).sort((a, b) => a - b);
      $("s-control").textContent = `${Math.round(recent[Math.floor((recent.length - 1) / 2)])} ms`;
    }
  }
  if (state.transport === "frames") $("s-buffer").textContent = `${(state.frames.length / state.config.fps).toFixed(2)} s`;
  requestAnimationFrame(drawFrames);
}
requestAnimationFrame(drawFrames);

function onFrameBatch(header, payload) {
  // raw RGB frames of one batch (of one chunk): queue them for the canvas; a chunk's first batch counts it
  const n = header.num_frames, size = header.width * header.height * 3;
  if (payload.length !== n * size) throw new RangeError(`batch of ${payload.length} bytes for ${n} frames`);
  if (header.frame_batch_index === 0) {
    const id = header.event_id === undefined ? null : header.event_id;
    if (id !== null && id !== state.echoed && id in state.sentAt) {
      state.pendingShows.push({ id, sentAt: state.sentAt[id], frame: state.framesReceived });
      state.startedEvents.push(id);
      state.acks += 1; $("s-acks").textContent = state.acks;
      log(`chunk ${header.chunk_index}: applies event ${id}`);
    }
    state.echoed = id;
    onChunk({ started_event_ids: [], num_frames: 0, generation_chunk_index: header.chunk_index }, null);
  }
  for (let i = 0; i < n; i++) {
    state.frames.push({ rgb: payload.subarray(i * size, (i + 1) * size), width: header.width, height: header.height });
  }
  if (!state.framesReceived) state.nextFrameAt = performance.now();
  state.framesReceived += n;
  state.videoSeconds += n / state.config.fps;
}

// The API key goes in a subprotocol, never in a URL (URLs end up in the history and in proxies' logs): the page
// offers "lingbot" and "lingbot-key." + the key's UTF-8 in unpadded base64url; the server answers "lingbot".
function keySubprotocols(key) {
  if (!key) return ["lingbot"];
  const b64 = btoa(String.fromCharCode(...new TextEncoder().encode(key)));
  return ["lingbot", "lingbot-key." + b64.replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "")];
}

function apiKey() {
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem("lingbot-api-key", key); else sessionStorage.removeItem("lingbot-api-key");
  return key;
}

function startFrames(proto, key, worldId) {
  // the second protocol: MessagePack maps in binary messages; raw frames, drawn on the canvas
  const ws = new WebSocket(`${proto}://${location.host}/v1/realtime_video/generate`, keySubprotocols(key));
  ws.binaryType = "arraybuffer";
  state.ws = ws;
  let pendingHeader = null;
  ws.onopen = () => {
    const msg = worldId ? { type: "init", model: "lingbot-world", world_id: worldId, realtime_output_format: "raw" }
      : { type: "init", model: "lingbot-world", prompt: $("prompt").value, first_frame: state.imageUrl,
          size: `${state.config.width}x${state.config.height}`, fps: state.config.fps,
          seed: parseInt($("seed").value || "0", 10), realtime_output_format: "raw" };
    if (!$("endless").checked) msg.max_chunks = Math.max(1, parseInt($("chunks").value || "1", 10));
    ws.send(MsgPack.encode(msg));
    state.running = true;
    setStatus("starting…");
    $("start").disabled = true; $("stop").disabled = false;
    state.canSave(true);
  };
  ws.onmessage = (e) => {
    const data = new Uint8Array(e.data);
    if (pendingHeader) { const h = pendingHeader; pendingHeader = null; onFrameBatch(h, data); return; }
    const msg = MsgPack.decode(data);
    if (msg.type === "frame_batch_header") pendingHeader = msg;
    else if (msg.type === "frame_batch") onFrameBatch(msg, msg.payload);
    else if (msg.type === "error") {
      state.errors.push({ code: msg.code, message: msg.content });
      setStatus(`${msg.code || "error"}: ${msg.content}`, true);
      log(`error ${msg.code || ""}: ${msg.content}`);
    } else if (msg.type === "queued") {
      showQueued(msg);
    } else if (msg.type === "saved") {
      state.onSaved(msg);
    } else if (msg.type === "session_resumed") {
      state.onResumed(msg);
    } else if (msg.type === "chunk_stats") {
      if (msg.quality) $("s-quality").textContent = msg.quality;
      if (state.chunks === 1) setStatus(`session ${msg.session_id.slice(0, 8)}`);
    }
  };
  ws.onclose = (e) => {
    state.running = false;
    state.canSave(false);
    $("start").disabled = false; $("stop").disabled = true;
    if (e.code === 1000) setStatus(`done: ${state.chunks} chunks (${e.reason || "closed"})`);
    else log(`connection closed (${e.code}${e.reason ? ": " + e.reason : ""})`);
  };
}

setInterval(() => {
  const v = $("video");
  if (state.transport === "frames") return;
  if (v.buffered.length) $("s-buffer").textContent = `${(v.buffered.end(v.buffered.length - 1) - v.currentTime).toFixed(2)} s`;
  const q = v.getVideoPlaybackQuality ? v.getVideoPlaybackQuality() : null;
  if (q) $("s-frames").textContent = q.totalVideoFrames;
}, 250);

function start(worldId) {
  // a new session; with `worldId`, one that goes on from that saved world (its first frame, prompt and seed)
  if (!state.config) return;
  resetStats();
  const proto = location.protocol === "https:" ? "wss" : "ws";
  const key = apiKey();
  state.transport = $("transport").value;
  $("video").style.display = state.transport === "frames" ? "none" : "block";
  $("canvas").style.display = state.transport === "frames" ? "block" : "none";
  if (state.transport === "frames") { startFrames(proto, key, worldId); return; }
  const ws = new WebSocket(`${proto}://${location.host}/v1/realtime/video`, keySubprotocols(key));
  ws.binaryType = "arraybuffer";
  state.ws = ws;
  let pendingMeta = null;
  ws.onopen = () => {
    const chunks = Math.max(1, parseInt($("chunks").value || "1", 10));
    const msg = worldId ? { type: "session.start", model: "lingbot-world", world_id: worldId, extra_params: {} }
      : { type: "session.start", model: "lingbot-world", prompt: $("prompt").value,
          image_reference: { image_url: state.imageUrl }, width: state.config.width,
          height: state.config.height, fps: state.config.fps, seed: parseInt($("seed").value || "0", 10),
          extra_params: {} };
    if ($("endless").checked) msg.extra_params.endless = true;
    else msg.num_frames = worldId ? chunks * 12 : (3 * chunks - 1) * 4 + 1;   // a world's chunks all have 12
    ws.send(JSON.stringify(msg));
    setStatus("starting…");
    $("start").disabled = true; $("stop").disabled = false;
  };
  ws.onmessage = (e) => {
    if (typeof e.data !== "string") { onChunk(pendingMeta, e.data); return; }
    const msg = JSON.parse(e.data);
    if (msg.type === "video.start") {
      state.running = true;
      setStatus(`session ${msg.request_id.slice(0, 8)}`);
      setupMedia(msg.config.mime);
      state.canShare(true);
      state.canSave(true);
    } else if (msg.type === "session.shared" || msg.type === "session.unshared") {
      state.onShared(msg);
    } else if (msg.type === "session.saved") {
      state.onSaved(msg);
    } else if (msg.type === "session.resumed") {
      state.onResumed(msg);
    } else if (msg.type === "video.chunk_metadata") {
      pendingMeta = msg;
    } else if (msg.type === "session.queued") {
      showQueued(msg);
    } else if (msg.type === "session.interaction.queued") {
      state.acks += 1; $("s-acks").textContent = state.acks;
    } else if (msg.type === "session.done") {
      setStatus(`done: ${msg.chunks} chunks${msg.stopped ? " (stopped)" : ""}`);
      log(`session done after ${msg.chunks} chunks`);
    } else if (msg.type === "error") {
      state.errors.push(msg);
      setStatus(`${msg.code}: ${msg.message}`, true);
      log(`error ${msg.code}: ${msg.message}`);
    }
  };
  ws.onclose = (e) => {
    state.running = false;
    state.canShare(false);
    state.canSave(false);
    $("start").disabled = false; $("stop").disabled = true;
    if (e.code !== 1000 && e.code !== 1005) log(`connection closed (${e.code}${e.reason ? ": " + e.reason : ""})`);
    const ms = state.mediaSource;
    const finish = () => { try { if (ms && ms.readyState === "open") ms.endOfStream(); } catch (err) {} };
    if (state.sourceBuffer && (state.sourceBuffer.updating || state.queue.length)) {
      const wait = setInterval(() => {
        if (!state.sourceBuffer.updating && !state.queue.length) { clearInterval(wait); finish(); }
      }, 100);
    } else finish();
  };
}

$("start").addEventListener("click", () => start());
$("stop").addEventListener("click", () => {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return;
  if (state.transport === "frames") state.ws.close(1000, "stopped");     // the protocol ends a session by closing
  else state.ws.send(JSON.stringify({ type: "session.stop" }));
});
setInterval(() => {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return;
  if (state.transport === "frames") state.ws.send(MsgPack.encode({ type: "event", kind: "heartbeat" }));
  else state.ws.send(JSON.stringify({ type: "session.ping", t: Date.now() }));
}, 10000);

// a key in the page's own URL (/?api_key=KEY, as older links had it) moves to the field and out of the URL
(function keyOutOfTheUrl() {
  const params = new URLSearchParams(location.search);
  const fromUrl = params.get("api_key");
  if (fromUrl !== null) {
    params.delete("api_key");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
  }
  $("api-key").value = fromUrl || sessionStorage.getItem("lingbot-api-key") || "";
})();
state.keySubprotocols = keySubprotocols;
loadConfig().catch((err) => setStatus(`cannot reach the server: ${err}`, true));
