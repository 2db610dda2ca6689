/* Requests: the request log (GET /admin/requests) newest first, filtered by key, team, model, deployment, status,
 * error code and time; "load more" pages back with the cursor, a live tail polls `?after=` every second, one
 * request's detail shows every field and its attempts as a timeline, and the loaded rows download as CSV. The filter
 * lives in the hash (#/requests?key=key_…&status=429), so the Keys and Models pages link here. The log never holds
 * a prompt or an answer, so neither can show here. */
(function () {
  'use strict';
  const UG = window.UG;
  const h = UG.h;
  const SVG = 'http://www.w3.org/2000/svg';
  const PAGE_SIZE = 50;
  const TAIL_MS = 1000;
  const TAIL_BATCH = 500;
  const MAX_ROWS = 2000; // while tailing, older rows beyond this are let go (Apply pages through them again)
  const FILTERS = [
    ['key', 'Key id (or master)', 'key_…'], ['team', 'Team id', 'team_…'], ['model', 'Model (as requested)', ''],
    ['deployment', 'Deployment', ''], ['status', 'Status', '429'], ['code', 'Error code', 'rate_limit_exceeded'],
  ];
  const RANGES = [
    ['', 'All retained', 0], ['15m', 'Last 15 minutes', 900000], ['1h', 'Last hour', 3600000],
    ['24h', 'Last 24 hours', 86400000], ['7d', 'Last 7 days', 7 * 86400000], ['custom', 'From / to', 0],
  ];
  const CSV_COLUMNS = ['time', 'request_id', 'key_id', 'key_name', 'team_id', 'api', 'route', 'model', 'deployment',
    'fallback', 'status', 'code', 'ended_by', 'stream', 'attempts', 'prompt_tokens', 'completion_tokens',
    'cached_tokens', 'estimated', 'cost_usd', 'ttft_ms', 'duration_ms'];

  function ms(value) {
    return value === null || value === undefined ? '—' : UG.fmt(value, value >= 100 ? 0 : 1) + ' ms';
  }

  function localTime(iso) {
    const d = new Date(iso);
    const pad = (n, w) => String(n).padStart(w || 2, '0');
    return d.getFullYear() + '-' + pad(d.getMonth() + 1) + '-' + pad(d.getDate()) + ' ' + pad(d.getHours()) + ':' +
      pad(d.getMinutes()) + ':' + pad(d.getSeconds()) + '.' + pad(d.getMilliseconds(), 3);
  }

  /** A datetime-local input's value (local time) as RFC 3339 UTC; '' when empty. */
  function isoOf(local) {
    return local ? new Date(local).toISOString() : '';
  }

  function localValue(iso) {
    const t = Date.parse(iso);
    if (!isFinite(t)) return '';
    return new Date(t - new Date(t).getTimezoneOffset() * 60000).toISOString().slice(0, 16);
  }

  function statusClass(status) {
    if (status >= 200 && status < 300) return 's2xx';
    if (status === 499 || status >= 500 || status === 0) return 's5xx';
    return 's4xx';
  }

  function attemptsText(record) {
    return record.attempts.map((a) => a.deployment + ':' + a.status + ':' + a.duration_ms + (a.code ? ':' + a.code : ''))
      .join(' ');
  }

  function csvRow(record) {
    const flat = Object.assign({}, record, record.usage, { attempts: attemptsText(record) });
    return CSV_COLUMNS.map((c) => UG.csvCell(flat[c])).join(',');
  }

  UG.requestsCsv = function (records) {
    return [CSV_COLUMNS.join(',')].concat(records.map(csvRow)).join('\r\n') + '\r\n';
  };

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
    return node;
  }

  /** The attempts as bars scaled to the request's duration, one row each, placed at their start (`start_ms`; records
   * without one are laid end to end); the TTFT as a vertical mark. SVG attributes only. */
  function timeline(record) {
    const attempts = record.attempts;
    const total = Math.max(record.duration_ms || 0, record.ttft_ms || 0,
      attempts.reduce((end, a) => Math.max(end + a.duration_ms, (a.start_ms || 0) + a.duration_ms), 0), 0.001);
    const x = (t) => (100 * Math.min(1, Math.max(0, t / total))).toFixed(2) + '%';
    const row = 22;
    const height = row * (attempts.length + 1) + 18;
    const chart = svg('svg', { width: '100%', height: height, id: 'req-timeline', role: 'img',
      'aria-label': 'attempts timeline' });
    chart.appendChild(svg('rect', { x: 0, y: 4, width: '100%', height: 14, fill: '#eef1f4', 'data-bar': 'request' }));
    const label = (text, at, y, anchor) => {
      const node = svg('text', { x: at, y: y, 'font-size': 11, fill: '#1d2329', 'text-anchor': anchor || 'start' });
      node.textContent = text;
      chart.appendChild(node);
    };
    label('request · ' + ms(record.duration_ms), '0.5%', 15);
    let start = 0;
    attempts.forEach((a, i) => {
      if (typeof a.start_ms === 'number' && a.start_ms > 0) start = a.start_ms;
      const y = row * (i + 1) + 4;
      const ok = a.status >= 200 && a.status < 300;
      const bar = svg('rect', { x: x(start), y: y, width: x(Math.max(a.duration_ms, total / 500)), height: 14,
        fill: ok ? '#2e8b57' : '#c0392b', 'data-attempt': i, 'data-status': a.status });
      const title = svg('title', {});
      title.textContent = a.deployment + ' · ' + (a.status || 'no answer') + (a.code ? ' ' + a.code : '') + ' · ' +
        ms(a.duration_ms);
      bar.appendChild(title);
      chart.appendChild(bar);
      const end = start + a.duration_ms;
      const right = end / total > 0.6;
      label(a.deployment + ' · ' + (a.status || 'no answer') + ' · ' + ms(a.duration_ms),
        right ? x(start) : x(end), y + 11, right ? 'end' : 'start');
      start = end;
    });
    if (record.ttft_ms !== null && record.ttft_ms !== undefined) {
      const at = x(record.ttft_ms);
      chart.appendChild(svg('line', { x1: at, x2: at, y1: 0, y2: height - 14, stroke: '#2f6fdb', 'stroke-width': 2,
        'stroke-dasharray': '3 2', 'data-ttft': record.ttft_ms }));
      label('TTFT ' + ms(record.ttft_ms), at, height - 3, record.ttft_ms / total > 0.5 ? 'end' : 'start');
    }
    return h('div', { class: 'timeline' }, chart);
  }

  UG.pages.requests = {
    title: 'Requests',
    render(root) {
      const params = UG.hashParams();
      const inputs = {};
      for (const [name, , placeholder] of FILTERS) {
        inputs[name] = h('input', { name: name, id: 'req-' + name, value: params.get(name) || '',
          placeholder: placeholder, type: name === 'status' ? 'number' : 'text', min: name === 'status' ? 100 : null,
          max: name === 'status' ? 599 : null });
      }
      const range = h('select', { id: 'req-range' }, RANGES.map(([value, text]) => h('option',
        { value: value, selected: value === (params.get('range') || (params.get('since') || params.get('until')
          ? 'custom' : '')) }, text)));
      const since = h('input', { type: 'datetime-local', id: 'req-since', value: localValue(params.get('since')) });
      const until = h('input', { type: 'datetime-local', id: 'req-until', value: localValue(params.get('until')) });
      const custom = h('span', { class: 'row', hidden: range.value !== 'custom' },
        h('label', {}, 'From (local time)', since), h('label', {}, 'To', until));
      range.addEventListener('change', () => { custom.hidden = range.value !== 'custom'; });
      const tailToggle = h('input', { type: 'checkbox', id: 'req-tail' });
      const error = h('p', { class: 'error', role: 'alert' });
      const notice = h('p', { class: 'muted', id: 'req-notice' });
      const detail = h('div', { id: 'req-detail' });
      const tbody = h('tbody', {});
      const more = h('button', { type: 'button', class: 'secondary', id: 'req-more', hidden: true, onclick: loadMore },
        'Load more');
      const count = h('span', { class: 'muted', id: 'req-count' });
      const state = { query: '', rows: [], seen: new Set(), cursor: null, gen: 0, position: null, stopTail: null,
        filter: {}, trimmed: false, numDropped: 0 };

      const form = h('form', { id: 'req-filters', autocomplete: 'off' },
        h('div', { class: 'row' },
          FILTERS.map(([name, label]) => h('label', {}, label, inputs[name])),
          h('label', {}, 'Time', range), custom,
          h('button', { type: 'submit', id: 'req-apply' }, 'Apply'),
          h('button', { type: 'button', class: 'secondary', onclick: reset }, 'Clear')),
        error);
      form.addEventListener('submit', (event) => { event.preventDefault(); apply(); });
      const lookup = h('input', { id: 'req-lookup', placeholder: 'x-request-id', 'aria-label': 'Request id',
        autocomplete: 'off' });
      const opener = h('form', { class: 'row', id: 'req-open' }, h('label', {}, 'Open one request', lookup),
        h('button', { type: 'submit', class: 'secondary' }, 'Open'));
      opener.addEventListener('submit', (event) => {
        event.preventDefault();
        if (lookup.value.trim()) showDetail(lookup.value.trim());
      });
      tailToggle.addEventListener('change', () => { if (tailToggle.checked) startTail(); else stopTail(); });

      root.append(
        h('div', { class: 'row' }, h('h1', { class: 'grow' }, 'Requests'), opener,
          h('label', { class: 'inline' }, tailToggle, 'Live tail'),
          h('button', { type: 'button', class: 'secondary', id: 'req-csv', onclick: download }, 'Download CSV')),
        h('div', { class: 'card' }, form),
        detail,
        h('div', { class: 'card' },
          h('div', { class: 'table-wrap' }, h('table', { id: 'req-table' },
            h('thead', {}, h('tr', {}, ['Time', 'Request', 'Key', 'Model → deployment', 'Status', 'Tokens in / out',
              'Cost (USD)', 'TTFT', 'Duration'].map((t, i) => h('th', {
              class: (i >= 5 ? 'num' : '') + (i === 6 ? ' hide-narrow' : '') }, t)))),
            tbody)),
          h('div', { class: 'row' }, more, count), notice));

      /** The filter as the form says it: the API's query (times fixed now) and the same test for tailed records. */
      function readForm() {
        const query = new URLSearchParams();
        const hash = new URLSearchParams();
        const filter = {};
        for (const [name] of FILTERS) {
          const value = inputs[name].value.trim();
          if (!value) continue;
          query.set(name, value);
          hash.set(name, value);
          filter[name] = value;
        }
        if (range.value === 'custom') {
          const from = isoOf(since.value);
          const to = isoOf(until.value);
          if (from) { query.set('since', from); hash.set('since', from); filter.since = Date.parse(from); }
          if (to) { query.set('until', to); hash.set('until', to); filter.until = Date.parse(to); }
        } else if (range.value) {
          const from = new Date(Date.now() - RANGES.find((r) => r[0] === range.value)[2]).toISOString();
          query.set('since', from);
          hash.set('range', range.value);
          filter.since = Date.parse(from);
        }
        return { query: query.toString(), hash: hash, filter: filter };
      }

      /** What GET /admin/requests keeps, for the records the tail brings (it reads every record). */
      function matches(record) {
        const f = state.filter;
        const t = Date.parse(record.time);
        return (!f.key || record.key_id === f.key) && (!f.team || (record.team_id || '') === f.team) &&
          (!f.model || record.model === f.model) && (!f.deployment || record.deployment === f.deployment) &&
          (!f.status || record.status === Number(f.status)) && (!f.code || record.code === f.code) &&
          (f.since === undefined || t >= f.since) && (f.until === undefined || t < f.until);
      }

      async function apply() {
        const read = readForm();
        const hash = read.hash;
        if (detail.dataset.requestId) hash.set('id', detail.dataset.requestId);
        UG.replaceHashParams(hash);
        let position = null;
        if (state.stopTail) {  // the tail goes on from here: the listing below holds everything older
          try { position = (await UG.api('GET', '/admin/requests?after=now')).position; } catch (e) { /* below */ }
        }
        const gen = ++state.gen;  // a page or a tail poll begun before this is dropped when it answers
        if (position !== null) state.position = position;
        state.query = read.query;
        state.filter = read.filter;
        state.rows = [];
        state.seen = new Set();
        state.cursor = null;
        state.trimmed = false;
        error.textContent = '';
        UG.clear(tbody);
        await page(gen);
      }

      function loadMore() { page(state.gen); }

      async function page(gen) {
        more.disabled = true;
        let result;
        try {
          result = await UG.api('GET', '/admin/requests?limit=' + PAGE_SIZE + (state.query ? '&' + state.query : '') +
            (state.cursor ? '&cursor=' + encodeURIComponent(state.cursor) : ''));
        } catch (e) {
          if (gen === state.gen) { error.textContent = e.message; more.disabled = false; }
          return;
        }
        if (gen !== state.gen) return;
        const fresh = result.data.filter((r) => !state.seen.has(r.request_id));
        for (const record of fresh) {
          state.seen.add(record.request_id);
          state.rows.push(record);
          tbody.appendChild(rowOf(record));
        }
        state.cursor = result.next_cursor;
        state.numDropped = result.num_dropped;
        more.disabled = false;
        drawFooter();
      }

      function drawFooter() {
        const numDropped = state.numDropped;
        more.hidden = !state.cursor || state.trimmed;
        const shown = state.rows.length;
        count.textContent = shown ? UG.fmt(shown) + (shown === 1 ? ' request' : ' requests') + ' loaded' +
          (state.cursor && !state.trimmed ? '; older ones: Load more' : '') : '';
        if (!shown && !tbody.querySelector('tr.empty')) {
          tbody.appendChild(h('tr', { class: 'empty' }, h('td', { colspan: 9, class: 'muted' },
            state.cursor ? 'None yet in the records read: Load more reads older ones.' : 'No requests match.')));
        }
        if (shown) for (const empty of tbody.querySelectorAll('tr.empty')) empty.remove();
        const parts = [];
        if (numDropped) parts.push(UG.fmt(numDropped) + ' records could not be written by this gateway instance ' +
          '(Redis was unreachable too long).');
        if (state.trimmed) parts.push('Older rows were let go while tailing: Apply to page through them again.');
        notice.textContent = parts.join(' ');
      }

      function rowOf(record) {
        const id = record.request_id;
        const open = h('button', { type: 'button', class: 'link mono', 'data-open': id, title: id,
          onclick: () => showDetail(id) }, id.length > 14 ? id.slice(0, 12) + '…' : id);
        return h('tr', { 'data-request-id': record.request_id, 'data-status': record.status },
          h('td', { title: record.time }, localTime(record.time).slice(11),
            h('div', { class: 'muted' }, localTime(record.time).slice(0, 10))),
          h('td', {}, open),
          h('td', {}, record.key_name || record.key_id, record.key_name ? h('div', { class: 'muted' }, record.key_id)
            : null),
          h('td', {}, record.model, h('div', { class: 'muted' }, record.deployment
            ? '→ ' + record.deployment + (record.fallback ? ' (fallback ' + record.fallback + ')' : '') : '→ none')),
          h('td', {}, h('span', { class: 'badge ' + statusClass(record.status) }, String(record.status)),
            record.code ? h('div', { class: 'muted', 'data-code': record.code }, record.code) : null,
            record.ended_by === 'client_left' || record.ended_by === 'timeout'
              ? h('div', { class: 'muted', 'data-ended-by': record.ended_by }, record.ended_by.replace('_', ' ')) : null),
          h('td', { class: 'num' }, UG.fmt(record.usage.prompt_tokens) + ' / ' + UG.fmt(record.usage.completion_tokens) +
            (record.usage.estimated ? ' (est.)' : '')),
          h('td', { class: 'num hide-narrow' }, record.cost_usd),
          h('td', { class: 'num' }, ms(record.ttft_ms)),
          h('td', { class: 'num' }, ms(record.duration_ms)));
      }

      function startTail() {
        if (state.stopTail) state.stopTail();
        let started = false;
        state.stopTail = UG.every(TAIL_MS, async () => {
          if (!started) {  // from now: what is older comes from the listing
            state.position = (await UG.api('GET', '/admin/requests?after=now')).position;
            started = true;
            tailToggle.dataset.ready = 'true';
            return;
          }
          const at = state.gen;
          const result = await UG.api('GET', '/admin/requests?limit=' + TAIL_BATCH + '&after=' +
            encodeURIComponent(state.position));
          if (at !== state.gen || !state.stopTail) return;
          state.position = result.position;
          let first = tbody.firstChild;
          for (const record of result.data) {  // oldest first: each goes on top of the previous one
            if (!matches(record) || state.seen.has(record.request_id)) continue;
            state.seen.add(record.request_id);
            state.rows.unshift(record);
            const tr = rowOf(record);
            tr.classList.add('fresh');
            tbody.insertBefore(tr, first);
            first = tr;
          }
          while (state.rows.length > MAX_ROWS) {
            const gone = state.rows.pop();
            state.seen.delete(gone.request_id);
            tbody.lastChild.remove();
            state.trimmed = true;
          }
          drawFooter();
        });
      }

      function stopTail() {
        if (state.stopTail) state.stopTail();
        state.stopTail = null;
        tailToggle.checked = false;
        delete tailToggle.dataset.ready;
      }

      async function showDetail(requestId) {
        detail.dataset.requestId = requestId;
        const hash = UG.hashParams();
        hash.set('id', requestId);
        UG.replaceHashParams(hash);
        let record;
        try {
          record = await UG.api('GET', '/admin/requests/' + encodeURIComponent(requestId));
        } catch (e) {
          if (detail.dataset.requestId !== requestId) return;
          UG.clear(detail).appendChild(h('div', { class: 'card' }, h('p', { class: 'error' }, e.message),
            h('button', { type: 'button', class: 'secondary', id: 'req-detail-close', onclick: closeDetail },
              'Close')));
          return;
        }
        if (detail.dataset.requestId !== requestId) return;
        const link = (name, value) => value ? h('a', { href: '#/requests?' + name + '=' + encodeURIComponent(value) },
          value) : '—';
        const fields = [
          ['Time', localTime(record.time) + ' (' + record.time + ')'],
          ['Request id', h('code', {}, record.request_id)],
          ['Key', h('span', {}, (record.key_name ? record.key_name + ' · ' : ''), link('key', record.key_id))],
          ['Team', link('team', record.team_id)],
          ['API', record.api + ' · ' + record.route + (record.stream ? ' · stream' : '')],
          ['Model (as requested)', link('model', record.model)],
          ['Deployment', link('deployment', record.deployment)],
          ['Fallback', record.fallback || '—'],
          ['Status', h('span', {}, h('span', { class: 'badge ' + statusClass(record.status) }, String(record.status)),
            record.code ? ' ' + record.code : '')],
          ['Ended by', record.ended_by],
          ['Prompt tokens', UG.fmt(record.usage.prompt_tokens)],
          ['Completion tokens', UG.fmt(record.usage.completion_tokens)],
          ['Cached tokens', UG.fmt(record.usage.cached_tokens)],
          ['Token counts', record.usage.estimated ? "the gateway's estimate (no usage came back)" : 'as reported'],
          ['Cost (USD)', record.cost_usd],
          ['TTFT', ms(record.ttft_ms)],
          ['Duration', ms(record.duration_ms)],
        ];
        const attempts = record.attempts.map((a, i) => h('tr', { 'data-attempt': i },
          h('td', {}, String(i + 1)), h('td', {}, a.deployment),
          h('td', {}, h('span', { class: 'badge ' + statusClass(a.status) }, a.status ? String(a.status) : 'no answer')),
          h('td', {}, a.code || '—'), h('td', { class: 'num' }, ms(a.duration_ms))));
        UG.clear(detail).appendChild(h('div', { class: 'card', 'data-detail': record.request_id },
          h('div', { class: 'row' }, h('h2', { class: 'grow' }, 'Request ' + record.request_id),
            h('button', { type: 'button', class: 'secondary', id: 'req-detail-close', onclick: closeDetail }, 'Close')),
          h('dl', { class: 'fields' }, fields.map(([name, value]) => [h('dt', {}, name), h('dd', {}, value)])),
          h('h2', {}, 'Attempts'),
          record.attempts.length ? timeline(record)
            : h('p', { class: 'muted' }, 'No attempt: the gateway answered itself (a limit, a refusal).'),
          record.attempts.length ? h('p', { class: 'muted' }, 'Bars are laid end to end from the request\'s start, ' +
            'scaled to its duration; what no bar covers is the gateway\'s own time (admission, waits for a slot, ' +
            'backoff between tries, the settle).') : null,
          record.attempts.length ? h('div', { class: 'table-wrap' }, h('table', { id: 'req-attempts' },
            h('thead', {}, h('tr', {}, ['#', 'Deployment', 'Status', 'Code', 'Duration'].map((t, i) =>
              h('th', { class: i === 4 ? 'num' : '' }, t)))),
            h('tbody', {}, attempts))) : null));
        detail.scrollIntoView({ block: 'nearest' });
      }

      function closeDetail() {
        delete detail.dataset.requestId;
        UG.clear(detail);
        const hash = UG.hashParams();
        hash.delete('id');
        UG.replaceHashParams(hash);
      }

      function reset() {
        for (const [name] of FILTERS) inputs[name].value = '';
        range.value = '';
        since.value = '';
        until.value = '';
        custom.hidden = true;
        apply();
      }

      function download() {
        const stamp = new Date().toISOString().slice(0, 19).replace(/:/g, '');
        UG.download('unigate-requests-' + stamp + '.csv', UG.requestsCsv(state.rows));
      }

      UG.onLeave(stopTail);
      apply();
      if (params.get('id')) showDetail(params.get('id'));
    },
  };
})();
