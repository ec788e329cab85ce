// lingbot-serve web page, sharing: the owner's "share" button (session.share) and the watch link it makes, the
// number of viewers the server reports; and the same page opened with ?watch=ID, which plays that shared
// session watch-only over WS /v1/realtime/watch/ID (no controls; the viewer sends keepalives only).
"use strict";

const sharing = { watchId: null, link: "", viewers: 0, watching: null, firstFragment: null, fragments: 0 };
window.lingbot.sharing = sharing;

function watchLink(id) {
  return `${location.origin}/?watch=${encodeURIComponent(id)}`;
}

// ---- the owner -----------------------------------------------------------------------------------
function onShared(msg) {
  // session.shared {watch_id, watch_url, viewers} (again whenever the number of viewers changed), or unshared
  if (msg.type === "session.unshared") {
    Object.assign(sharing, { watchId: null, link: "", viewers: 0 });
  } else {
    Object.assign(sharing, { watchId: msg.watch_id, link: watchLink(msg.watch_id), viewers: msg.viewers });
  }
  $("share-link").value = sharing.link;
  $("share-link").style.display = sharing.link ? "block" : "none";
  $("s-viewers").textContent = sharing.watchId ? String(sharing.viewers) : "–";
  $("share").textContent = sharing.watchId ? "Stop sharing" : "Share";
}

function canShare(running) {
  $("share").disabled = !running || state.transport !== "mse" || sharing.watching !== null;
  if (!running) onShared({ type: "session.unshared" });
}

$("share").addEventListener("click", () => {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return;
  state.ws.send(JSON.stringify({ type: sharing.watchId ? "session.unshare" : "session.share" }));
});
$("share-link").addEventListener("focus", () => $("share-link").select());

// ---- a viewer ------------------------------------------------------------------------------------
function watch(id) {
  // watch-only: the session's own stream from a keyframe on (watch.start, video.init + the init segment, then
  // video.chunk_metadata + one fragment per chunk), session.done at its end
  sharing.watching = id;
  document.body.classList.add("watching");
  $("status").textContent = "joining…";
  const proto = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${proto}://${location.host}/v1/realtime/watch/${encodeURIComponent(id)}`,
                           keySubprotocols(apiKey()));
  ws.binaryType = "arraybuffer";
  state.ws = ws;
  state.transport = "mse";
  resetStats();
  let pending = null;
  ws.onmessage = (e) => {
    if (typeof e.data !== "string") {
      if (pending && pending.type === "video.chunk_metadata") {
        if (sharing.firstFragment === null) sharing.firstFragment = Array.from(new Uint8Array(e.data));
        sharing.fragments += 1;
        onChunk({ ...pending, started_event_ids: [] }, e.data);      // (nothing the owner sent reaches a viewer)
      } else {
        state.queue.push(e.data);            // the init segment
        appendNext();
      }
      pending = null;
      return;
    }
    const msg = JSON.parse(e.data);
    if (msg.type === "watch.start") {
      state.running = true;
      setStatus("watching a shared session");
      setupMedia(msg.config.mime);
    } else if (msg.type === "video.init" || msg.type === "video.chunk_metadata") {
      pending = msg;
    } else if (msg.type === "session.done") {
      setStatus(`the session ended after ${msg.chunks} chunks${msg.stopped ? " (stopped)" : ""}`);
    } else if (msg.type === "error") {
      state.errors.push(msg);
      setStatus(`${msg.code}: ${msg.message}`, true);
    }
  };
  // a viewer joins mid-session: its first fragment is timed where the session was, so playback starts there
  const toTheStart = setInterval(() => {
    const v = $("video");
    if (v.buffered.length && v.currentTime < v.buffered.start(0)) v.currentTime = v.buffered.start(0);
    if (ws.readyState === WebSocket.CLOSED) clearInterval(toTheStart);
  }, 200);
  ws.onclose = () => {
    state.running = false;
    const ms = state.mediaSource;
    try { if (ms && ms.readyState === "open" && !state.queue.length) ms.endOfStream(); } catch (err) {}
  };
}

(function watchFromTheUrl() {
  const id = new URLSearchParams(location.search).get("watch");
  if (id) {
    const waitForConfig = setInterval(() => {
      if (state.config) { clearInterval(waitForConfig); watch(id); }
    }, 50);
  }
})();
window.lingbot.canShare = canShare;
window.lingbot.onShared = onShared;
