// lingbot-serve web page, worlds: the "Save world" button (session.save) while a session plays, the saved worlds
// of this key listed with their first frame (GET /v1/worlds, GET /v1/worlds/ID/frame), and "Resume" on each,
// which starts a session from that world (a start with its world_id: no image, no prompt: the world's own).
"use strict";

const worlds = { list: [], saved: [], thumbnails: 0, resumed: null };
window.lingbot.worlds = worlds;

function keyHeaders() {
  // the API key as a header (fetch can send one; an <img> cannot, so thumbnails come as blobs)
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function listWorlds() {
  const box = $("worlds-list");
  const r = await fetch("/v1/worlds", { headers: keyHeaders() });
  if (!r.ok) {
    box.textContent = r.status === 401 ? "the API key above lists its worlds" : "this server keeps no worlds";
    return;
  }
  worlds.list = (await r.json()).worlds;
  box.replaceChildren();
  for (const w of worlds.list) {
    const item = document.createElement("div");
    item.className = "world";
    const img = document.createElement("img");
    img.alt = `the first frame of world ${w.id.slice(0, 8)}`;
    const label = document.createElement("small");
    label.textContent = `${w.id.slice(0, 8)} · ${w.chunks} chunks` + (w.parent ? ` · from ${w.parent.slice(0, 8)}` : "");
    const resume = document.createElement("button");
    resume.textContent = "Resume";
    resume.dataset.world = w.id;
    resume.addEventListener("click", () => { if (!state.running) start(w.id); });
    item.append(img, label, resume);
    box.append(item);
    fetch(`/v1/worlds/${w.id}/frame`, { headers: keyHeaders() })
      .then((f) => (f.ok ? f.blob() : null))
      .then((blob) => {
        if (!blob) return;
        img.onload = () => { worlds.thumbnails += 1; };
        img.src = URL.createObjectURL(blob);
      });
  }
  if (!worlds.list.length) box.textContent = "no saved worlds yet";
}

function canSave(running) {
  $("save").disabled = !running || sharing.watching !== null;
}

function onSaved(msg) {
  // session.saved {world_id, chunk_index} (the second protocol's `saved`): the world is stored
  worlds.saved.push(msg);
  log(`world saved: ${msg.world_id.slice(0, 8)} (its chunks 0-${msg.chunk_index})`);
  listWorlds();
}

function onResumed(msg) {
  // session.resumed {reason: "saved", replayed_chunks, ...}: the world came back; its next chunk follows
  worlds.resumed = msg;
  log(`world resumed: ${msg.replayed_chunks} chunks replayed`);
}

$("save").addEventListener("click", () => {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return;
  state.ws.send(state.transport === "frames" ? MsgPack.encode({ type: "save" }) : JSON.stringify({ type: "session.save" }));
});
$("refresh-worlds").addEventListener("click", () => listWorlds());

(function listOnceConfigured() {
  const waitForConfig = setInterval(() => {
    if (state.config) { clearInterval(waitForConfig); if (!sharing.watching) listWorlds(); }
  }, 50);
})();
window.lingbot.canSave = canSave;
window.lingbot.onSaved = onSaved;
window.lingbot.onResumed = onResumed;
window.lingbot.listWorlds = listWorlds;
