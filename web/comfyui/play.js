// LingBot-World Play: the play panel. The node sends "lingbot.play" when it starts; the panel connects to the
// pack's WebSocket on ComfyUI's server, shows the frames as they come and sends keys while it has focus.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const MOVE = new Set(["KeyW", "KeyA", "KeyS", "KeyD", "KeyQ", "KeyE", "ShiftLeft", "ShiftRight",
  "ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight"]);

function fmt(v, d) { return v === null || v === undefined ? "–" : Number(v).toFixed(d); }

function openPanel(detail) {
  document.getElementById("lingbot-play")?.remove();
  const panel = document.createElement("div");
  panel.id = "lingbot-play";
  panel.tabIndex = 0;
  panel.style.cssText = "position:fixed;right:16px;top:64px;z-index:10000;background:#111;color:#ddd;" +
    "padding:8px;border:1px solid #444;border-radius:6px;font:12px monospace;outline:none";
  panel.innerHTML = '<div style="display:flex;justify-content:space-between;gap:8px">' +
    '<b>LingBot-World Play</b><span><button data-a="restart">Restart (R)</button> ' +
    '<button data-a="stop">Stop</button></span></div>' +
    '<img style="display:block;max-width:832px;margin-top:6px;cursor:grab;background:#000;min-width:416px;min-height:232px">' +
    '<pre data-a="hud" style="margin:4px 0"></pre>' +
    '<div>Click here, then W/A/S/D move, Shift run, Q/E down/up, arrows look, drag to look.</div>';
  document.body.appendChild(panel);
  window.lingbotPlayLog = [];  // every frame's index and camera (tests, curious users)
  const img = panel.querySelector("img"), hud = panel.querySelector('[data-a="hud"]');
  const url = new URL(api.apiURL(detail.ws), location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  let stats = {}, frames = 0, state = "connecting", blobUrl = null, drag = null;
  const draw = () => {
    const ms = (v) => (v === null || v === undefined ? "–" : (1000 * v).toFixed(0) + " ms");
    // the server paces the frames: the shown_* figures are as shown (a frame is shown when it arrives)
    hud.textContent = state + " | frames " + frames + " | FPS as played " + fmt(stats.shown_fps, 1) +
      " | s/chunk " + fmt(stats.s_per_chunk, 2) + " | key→pixel p50 " + ms(stats.shown_key_to_pixel_p50_s) +
      " p95 " + ms(stats.shown_key_to_pixel_p95_s) +
      (stats.vram ? " | VRAM " + fmt(stats.vram.allocated_gib, 1) + " GiB" : "");
  };
  const send = (o) => { if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(o)); };
  ws.onmessage = (ev) => {
    if (typeof ev.data === "string") {
      const m = JSON.parse(ev.data);
      if (m.type === "hello") state = m.role === "control" ? (m.ready ? "playing" : "loading") : "viewer";
      else if (m.type === "ready") state = "playing";
      else if (m.type === "stats") stats = m;
      else if (m.type === "error") state = "error: " + m.message;
      else if (m.type === "end") state = "ended: " + m.reason;
      draw();
      return;
    }
    const view = new DataView(ev.data);
    const p = []; for (let i = 0; i < 12; i++) p.push(view.getFloat32(16 + 4 * i, true));
    window.lingbotPlayLog.push({ index: view.getUint32(0, true), rollout: view.getUint32(4, true),
      latent: view.getUint32(8, true), x: p[3], y: p[7], z: p[11], yaw: Math.atan2(p[2], p[10]) * 180 / Math.PI });
    const blob = new Blob([new Uint8Array(ev.data, 64)], { type: "image/jpeg" });
    if (blobUrl) URL.revokeObjectURL(blobUrl);
    blobUrl = URL.createObjectURL(blob);
    img.src = blobUrl;
    frames += 1;
    draw();
  };
  ws.onclose = () => { if (!state.startsWith("ended")) state = "disconnected"; draw(); };
  const onKey = (ev, down) => {
    if (ev.code === "KeyR") { if (down && !ev.repeat) send({ type: "restart" }); }
    else if (MOVE.has(ev.code)) { if (!ev.repeat) send({ type: "key", key: ev.code, down }); }
    else return;
    ev.preventDefault();
    ev.stopPropagation();
  };
  panel.addEventListener("keydown", (ev) => onKey(ev, true));
  panel.addEventListener("keyup", (ev) => onKey(ev, false));
  panel.addEventListener("blur", () => { for (const code of MOVE) send({ type: "key", key: code, down: false }); });
  img.addEventListener("mousedown", (ev) => { drag = [ev.clientX, ev.clientY]; panel.focus(); ev.preventDefault(); });
  window.addEventListener("mouseup", () => { drag = null; });
  window.addEventListener("mousemove", (ev) => {
    if (!drag) return;
    const dx = ev.clientX - drag[0], dy = ev.clientY - drag[1];
    drag = [ev.clientX, ev.clientY];
    if (dx || dy) send({ type: "look", dx, dy });
  });
  panel.querySelector('[data-a="restart"]').onclick = () => send({ type: "restart" });
  panel.querySelector('[data-a="stop"]').onclick = () => { send({ type: "stop" }); };
  panel.focus();
  draw();
}

app.registerExtension({
  name: "LingBot.Play",
  setup() {
    api.addEventListener("lingbot.play", (ev) => openPanel(ev.detail));
  },
});
