// LingBot-World Play: what the standalone page (web/play/index.html, which `play` serves with this file) and
// the ComfyUI panel (play.js) share: the HUD's number formats, a frame message's header, and the input
// (keys, drag to look) as the session's messages. Exports only: ComfyUI loading it as an extension adds nothing.

export const MOVE = new Set(["KeyW", "KeyA", "KeyS", "KeyD", "KeyQ", "KeyE", "ShiftLeft", "ShiftRight",
  "ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight"]);

export function fmt(v, d) { return v === null || v === undefined ? "–" : Number(v).toFixed(d); }

export function ms(v) { return v === null || v === undefined ? "–" : (1000 * v).toFixed(0) + " ms"; }

// A binary frame message (session/play_server.py): {index, rollout, latent, x, y, z, yaw (degrees), jpeg}.
export function readFrame(data) {
  const view = new DataView(data);
  const p = []; for (let i = 0; i < 12; i++) p.push(view.getFloat32(16 + 4 * i, true));
  return {
    index: view.getUint32(0, true), rollout: view.getUint32(4, true), latent: view.getUint32(8, true),
    x: p[3], y: p[7], z: p[11], yaw: Math.atan2(p[2], p[10]) * 180 / Math.PI,  // forward axis (column 2): x over z
    jpeg: new Blob([new Uint8Array(data, 64)], { type: "image/jpeg" }),
  };
}

// A key event: R (pressed) restarts, a move key is sent as pressed/released (not its repeats); true when it
// was one of these (its default action prevented), false for any other key.
export function playKey(ev, down, send) {
  if (ev.code === "KeyR") { if (down && !ev.repeat) send({ type: "restart" }); }
  else if (MOVE.has(ev.code)) { if (!ev.repeat) send({ type: "key", key: ev.code, down }); }
  else return false;
  ev.preventDefault();
  return true;
}

// Every move key released (the page or panel lost focus).
export function releaseKeys(send) { for (const code of MOVE) send({ type: "key", key: code, down: false }); }

// Dragging on `img` sends "look" messages; `focus` (the element taking the keys) gets the focus on press.
export function dragToLook(img, focus, send) {
  let drag = null;
  img.addEventListener("mousedown", (ev) => { drag = [ev.clientX, ev.clientY]; focus.focus(); ev.preventDefault(); });
  window.addEventListener("mouseup", () => { drag = null; });
  window.addEventListener("mousemove", (ev) => {
    if (!drag) return;
    const dx = ev.clientX - drag[0], dy = ev.clientY - drag[1];
    drag = [ev.clientX, ev.clientY];
    if (dx || dy) send({ type: "look", dx, dy });
  });
}
