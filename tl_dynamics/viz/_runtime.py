"""The page's small runtime (inline, nonce'd; no network): decodes compact arrays, draws heat maps
and attention-head grids on canvases, and mounts every view lazily when it scrolls into view (or
its ``<details>`` opens). Token text is only ever set with ``textContent``, never parsed as HTML.
"""

from __future__ import annotations

RUNTIME_JS = r"""
(function () {
if (window.TLD) return;
var TLD = window.TLD = {};
function bytes(s) { var b = atob(s), out = new Uint8Array(b.length);
  for (var i = 0; i < b.length; i++) out[i] = b.charCodeAt(i); return out; }
async function inflate(s) {
  var stream = new Blob([bytes(s)]).stream().pipeThrough(new DecompressionStream('deflate'));
  return new Uint8Array(await new Response(stream).arrayBuffer()); }
async function decode(p) {
  var raw = await inflate(p.z);
  if (p.enc === 'f32') return {shape: p.shape, values: new Float32Array(raw.buffer, raw.byteOffset, raw.byteLength / 4)};
  return {shape: p.shape, codes: raw, lo: p.lo, hi: p.hi, scale: p.scale}; }
function value(d, q) { if (q === 255) return NaN; var t = q / 254; if (d.scale === 'sqrt') t = t * t;
  return d.lo + (d.hi - d.lo) * t; }
function nest(v, shape) {
  if (shape.length <= 1) return Array.from(v, function (x) { return Number.isNaN(x) ? null : x; });
  var step = shape.slice(1).reduce(function (a, b) { return a * b; }, 1), out = [];
  for (var i = 0; i < shape[0]; i++) out.push(nest(v.subarray(i * step, (i + 1) * step), shape.slice(1)));
  return out; }
async function revive(x) {
  if (Array.isArray(x)) return Promise.all(x.map(revive));
  if (x && typeof x === 'object') {
    if (x.$tld) { var d = await decode(x);
      var v = d.values || Float32Array.from(d.codes, function (q) { return value(d, q); });
      return nest(v, x.shape); }
    var out = {}; for (var k in x) out[k] = await revive(x[k]); return out; }
  return x; }
var MAPS = {blues: [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]],
            viridis: [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
            rdbu: [[178, 24, 43], [244, 165, 130], [247, 247, 247], [146, 197, 222], [33, 102, 172]]};
function ramp(stops, t) { t = Math.min(1, Math.max(0, t)); var x = t * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(x)), f = x - i;
  return stops[i].map(function (c, k) { return Math.round(c + (stops[i + 1][k] - c) * f); }); }
function colour(map, lo, hi, t) {  // t in [0, 1] along [lo, hi]; a diverging map is centred on 0
  if (map !== 'rdbu') return ramp(MAPS[map] || MAPS.blues, t);
  var m = Math.max(Math.abs(lo), Math.abs(hi)) || 1, v = lo + (hi - lo) * t;
  return ramp(MAPS.rdbu, 0.5 + 0.5 * v / m); }
function lut(d, map) { var out = new Uint8ClampedArray(256 * 4);
  for (var q = 0; q < 256; q++) { var c = q === 255 ? [226, 226, 226] : colour(map, d.lo, d.hi, (d.scale === 'sqrt' ? Math.pow(q / 254, 2) : q / 254));
    out.set([c[0], c[1], c[2], 255], q * 4); } return out; }
function el(tag, cls, text) { var e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; }
function fmt(v) { if (Number.isNaN(v)) return 'not defined'; var a = Math.abs(v);
  return (a !== 0 && (a < 1e-3 || a >= 1e4)) ? v.toExponential(2) : v.toPrecision(3); }
function paint(canvas, d, offset, rows, cols, map, mask) {
  var ctx = canvas.getContext('2d'), img = ctx.createImageData(cols, rows), L = lut(d, map);
  for (var r = 0; r < rows; r++) for (var c = 0; c < cols; c++) {
    var q = (mask && c > r) ? 255 : d.codes[offset + r * cols + c], o = (r * cols + c) * 4;
    img.data[o] = L[q * 4]; img.data[o + 1] = L[q * 4 + 1]; img.data[o + 2] = L[q * 4 + 2]; img.data[o + 3] = 255; }
  ctx.putImageData(img, 0, 0); }
function legend(d, map, name) {
  var box = el('div', 'tld-legend'), c = el('canvas'); c.width = 160; c.height = 10;
  var ctx = c.getContext('2d');
  for (var x = 0; x < 160; x++) { var t = x / 159, rgb = colour(map, d.lo, d.hi, d.scale === 'sqrt' ? t * t : t);
    ctx.fillStyle = 'rgb(' + rgb.join(',') + ')'; ctx.fillRect(x, 0, 1, 10); }
  box.appendChild(el('span', 'tld-legend-lo', fmt(d.lo))); box.appendChild(c);
  box.appendChild(el('span', 'tld-legend-hi', fmt(d.hi)));
  box.appendChild(el('span', 'tld-legend-name', name + (d.scale === 'sqrt' ? ' (colour spaced by square root)' : '')
    + '; grey: masked or not defined'));
  return box; }
function heatmap(host, d, offset, spec, note) {
  var rows = d.shape[d.shape.length - 2], cols = d.shape[d.shape.length - 1];
  var avail = host.clientWidth >= 300 ? host.clientWidth - 140 : 800;
  var s = Math.min(spec.cell || 16, (spec.maxPx || 480) / Math.max(rows, cols), avail / cols);
  var wrap = el('div', 'tld-hm'); if (spec.title) wrap.appendChild(el('div', 'tld-hm-title', spec.title));
  var grid = el('div', 'tld-hm-grid'), rl = spec.rowLabels, cl = spec.colLabels, show = s >= 9;
  var canvas = el('canvas', 'tld-hm-canvas'); canvas.width = cols; canvas.height = rows;
  canvas.style.width = (cols * s) + 'px'; canvas.style.height = (rows * s) + 'px';
  if (s < 1) canvas.style.imageRendering = 'auto';
  paint(canvas, d, offset, rows, cols, spec.cmap || 'blues', spec.mask);
  var rowBox = el('div', 'tld-hm-rows');
  if (show && rl) rl.forEach(function (t) { var x = el('div', 'tld-lab', t); x.style.height = s + 'px';
    x.style.lineHeight = s + 'px'; x.style.fontSize = Math.min(11, s - 1) + 'px'; rowBox.appendChild(x); });
  var colBox = el('div', 'tld-hm-cols');
  if (show && cl) cl.forEach(function (t) { var x = el('div', 'tld-lab tld-vert', t); x.style.width = s + 'px';
    x.style.fontSize = Math.min(11, s - 1) + 'px'; colBox.appendChild(x); });
  grid.appendChild(rowBox); grid.appendChild(canvas); grid.appendChild(el('div'));
  grid.appendChild(colBox); wrap.appendChild(grid);
  var tip = el('div', 'tld-tip', (spec.rowTitle || 'row') + ' down, ' + (spec.colTitle || 'column')
    + ' across: hover a cell to read it');
  canvas.addEventListener('mousemove', function (e) {
    var b = canvas.getBoundingClientRect(), r = Math.floor((e.clientY - b.top) / b.height * rows),
        c = Math.floor((e.clientX - b.left) / b.width * cols);
    if (r < 0 || c < 0 || r >= rows || c >= cols) return;
    var q = (spec.mask && c > r) ? 255 : d.codes[offset + r * cols + c];
    tip.textContent = (spec.rowTitle || 'row') + ' ' + r + (rl ? ' ' + JSON.stringify(rl[r]) : '') + ', '
      + (spec.colTitle || 'column') + ' ' + c + (cl ? ' ' + JSON.stringify(cl[c]) : '') + ': ' + fmt(value(d, q)); });
  wrap.appendChild(tip); wrap.appendChild(legend(d, spec.cmap || 'blues', spec.valueName || 'value'));
  if (note) wrap.appendChild(el('div', 'tld-note', note));
  host.appendChild(wrap); return wrap; }
async function heads(host, spec) {
  var th = await decode(spec.thumbs), full = {}, n = th.shape[0], t = th.shape[1], cols = spec.columns || n;
  for (var k in spec.full) full[k] = await decode(spec.full[k]);
  var rows = Math.ceil(n / cols), cell = t + 2, box = el('div', 'tld-heads');
  var avail = Math.max(240, (host.clientWidth || 800) - 60), px = Math.min(64, Math.floor(avail / cols)) / cell;
  var line = el('div', 'tld-heads-grid'), labels = el('div', 'tld-heads-rows');
  var canvas = el('canvas', 'tld-heads-canvas'); canvas.width = cols * cell; canvas.height = rows * cell;
  canvas.style.width = (cols * cell * px) + 'px'; canvas.style.height = (rows * cell * px) + 'px';
  var ctx = canvas.getContext('2d'); ctx.fillStyle = '#fff'; ctx.fillRect(0, 0, canvas.width, canvas.height);
  var L = lut(th, spec.cmap || 'blues'), img = ctx.createImageData(t, t);
  for (var h = 0; h < n; h++) {
    for (var i = 0; i < t * t; i++) { var q = (spec.mask && (i % t) > Math.floor(i / t)) ? 255 : th.codes[h * t * t + i];
      img.data.set([L[q * 4], L[q * 4 + 1], L[q * 4 + 2], 255], i * 4); }
    ctx.putImageData(img, (h % cols) * cell + 1, Math.floor(h / cols) * cell + 1);
    if (!(h in full)) { ctx.fillStyle = '#999'; ctx.fillRect((h % cols) * cell + 1, Math.floor(h / cols) * cell + t, t, 1); } }
  if (spec.rowNames) spec.rowNames.forEach(function (r) { var x = el('div', 'tld-lab', r);
    x.style.height = (cell * px) + 'px'; x.style.lineHeight = (cell * px) + 'px'; labels.appendChild(x); });
  line.appendChild(labels); line.appendChild(canvas);
  if (n > 1) { box.appendChild(line);
    box.appendChild(el('div', 'tld-axes', 'Click a head to see its pattern below' + (Object.keys(full).length < n
      ? '; heads underlined in grey are kept as thumbnails only' : '') + '.')); }
  var detail = el('div', 'tld-heads-detail'); box.appendChild(detail); host.appendChild(box);
  function pick(h) {
    detail.textContent = ''; var f = full[h], d = f || th;
    var note = f ? '' : 'Thumbnail only (' + t + ' x ' + t + ' cells, each the largest value of its block): '
      + 'this head\'s full pattern is not stored in the page; choose it with --heads to keep it.';
    heatmap(detail, d, f ? 0 : h * t * t, {title: spec.names[h], rowLabels: f ? spec.tokens : null,
      colLabels: f ? spec.tokens : null, rowTitle: spec.rowTitle, colTitle: spec.colTitle,
      valueName: spec.valueName, cmap: spec.cmap, mask: spec.mask, maxPx: spec.maxPx || 560}, note); }
  canvas.addEventListener('click', function (e) {
    var b = canvas.getBoundingClientRect(), c = Math.floor((e.clientX - b.left) / b.width * cols),
        r = Math.floor((e.clientY - b.top) / b.height * rows), h = r * cols + c; if (h < n) pick(h); });
  canvas.addEventListener('mousemove', function (e) {
    var b = canvas.getBoundingClientRect(), c = Math.floor((e.clientX - b.left) / b.width * cols),
        r = Math.floor((e.clientY - b.top) / b.height * rows), h = r * cols + c;
    canvas.title = h < n ? spec.names[h] : ''; });
  pick(spec.selected || 0); }
function circuitsvis() {  // in a notebook the bundle may come with an earlier output
  return new Promise(function (ok, fail) { var t0 = Date.now();
    (function poll() { if (window.CircuitsVis) ok(window.CircuitsVis);
      else if (Date.now() - t0 > 20000) fail(new Error('the circuitsvis script is not loaded: it comes '
        + 'with the first view of a kernel session; re-run this cell after '
        + 'tl_dynamics.viz.notebook_bundle("every")'));
      else setTimeout(poll, 50); })(); }); }
TLD.mount = async function (view) {
  if (view.dataset.state) return; view.dataset.state = 'loading';
  try {
    var spec = JSON.parse(document.getElementById(view.id + '-data').textContent);
    if (spec.kind === 'cv') { var CV = await circuitsvis();
      CV.render(view.id, CV[spec.name], await revive(spec.props));
      if (spec.note) view.insertAdjacentElement('afterend', el('div', 'tld-note', spec.note)); }
    else if (spec.kind === 'heatmap') { heatmap(view, await decode(spec.data), 0, spec); }
    else if (spec.kind === 'heads') { await heads(view, spec); }
    view.style.minHeight = ''; view.dataset.state = 'done';
  } catch (err) { view.dataset.state = 'error'; view.textContent = 'This view could not be drawn: ' + err; } };
TLD.start = function () {
  var views = Array.prototype.slice.call(document.querySelectorAll('.tld-view:not([data-state])'));
  if (!('IntersectionObserver' in window)) { views.forEach(TLD.mount); return; }
  var io = new IntersectionObserver(function (entries) { entries.forEach(function (e) {
    if (e.isIntersecting) { io.unobserve(e.target); TLD.mount(e.target); } }); }, {rootMargin: '300px 0px'});
  views.forEach(function (v) { io.observe(v); }); };
})();
"""
