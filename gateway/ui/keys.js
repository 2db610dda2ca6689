/* Keys: list (search, paging), create, edit limits, team, weight and priority, rotate, revoke; a usage sparkline per
 * key. */
(function () {
  'use strict';
  const UG = window.UG;
  const h = UG.h;
  const PAGE_SIZE = 20;
  const SPARK_DAYS = 14;
  const LIMIT_FIELDS = [
    ['rpm', 'Requests / min'], ['tpm', 'Tokens / min'], ['max_concurrent', 'Max concurrent'],
    ['token_budget', 'Token budget'], ['budget_usd', 'Budget (USD)'],
  ];

  function statusOf(key) {
    if (key.revoked) return 'revoked';
    if (key.is_expired) return 'expired';
    return 'active';
  }

  function limitsText(key) {
    const parts = [];
    if (key.rpm !== null) parts.push(key.rpm + ' rpm');
    if (key.tpm !== null) parts.push(key.tpm + ' tpm');
    if (key.max_concurrent !== null) parts.push(key.max_concurrent + ' conc.');
    if (key.token_budget !== null) parts.push(UG.fmt(key.token_budget) + ' tok/' + key.budget_period);
    if (key.budget_usd !== null) parts.push('$' + key.budget_usd + '/' + key.budget_period);
    return parts.join(', ') || 'unlimited';
  }

  /** The fields of a create / edit form as an admin API body; `changedOnly` keeps only edited ones (null clears). */
  function formBody(form, original) {
    const body = {};
    const value = (name) => form.elements[name].value.trim();
    const set = (name, parsed) => {
      if (!original || JSON.stringify(parsed) !== JSON.stringify(original[name] === undefined ? null : original[name])) {
        body[name] = parsed;
      }
    };
    set('name', value('name'));
    set('models', value('models') ? value('models').split(',').map((m) => m.trim()).filter(Boolean) : []);
    for (const [name] of LIMIT_FIELDS) {
      const raw = value(name);
      const parsed = raw === '' ? null : Number(raw);
      if (!original && parsed === null) continue;
      set(name, parsed);
    }
    set('budget_period', value('budget_period'));
    const team = value('team_id') || null;
    if (original ? team !== (original.team_id || null) : team) body.team_id = team;
    set('weight', value('weight') === '' ? 1 : Number(value('weight')));
    set('priority', value('priority'));
    const expires = value('expires_at');
    const expiresIso = expires ? new Date(expires).toISOString().replace('.000Z', 'Z') : null;
    if (!original ? expiresIso : expiresIso !== (original.expires_at || null)) body.expires_at = expiresIso;
    const metadata = value('metadata');
    if (metadata || original) set('metadata', metadata ? JSON.parse(metadata) : {});
    return body;
  }

  /** A select of every team (filled when the list arrives), the key's own selected; empty = no team. */
  function teamSelect(key) {
    const select = h('select', { name: 'team_id' }, h('option', { value: '' }, 'No team'));
    if (key && key.team_id) select.appendChild(h('option', { value: key.team_id, selected: true }, key.team_id));
    UG.teamNames().then((names) => {
      const current = select.value;
      UG.clear(select).appendChild(h('option', { value: '' }, 'No team'));
      for (const [id, name] of Object.entries(names)) {
        select.appendChild(h('option', { value: id, selected: id === current }, name + ' · ' + id));
      }
    }).catch(() => {});
    return select;
  }

  /** team id → name, for every team (pages of 500). */
  UG.teamNames = async function () {
    const names = {};
    let after = null;
    do {
      const page = await UG.api('GET', '/admin/teams?limit=500' + (after ? '&after=' + encodeURIComponent(after) : ''));
      for (const team of page.data) names[team.id] = team.name;
      after = page.has_more ? page.last_id : null;
    } while (after);
    return names;
  };

  function keyForm(key, onSubmit, submitLabel) {
    const local = key && key.expires_at ? new Date(key.expires_at) : null;
    const localValue = local ? new Date(local.getTime() - local.getTimezoneOffset() * 60000).toISOString().slice(0, 16) : '';
    const error = h('p', { class: 'error', role: 'alert' });
    const form = h('form', { class: 'key-form', autocomplete: 'off' },
      h('div', { class: 'grid' },
        h('label', {}, 'Name', h('input', { name: 'name', value: key ? key.name : '', maxlength: 200 })),
        h('label', {}, 'Models (comma-separated, * wildcards; empty = all)',
          h('input', { name: 'models', value: key ? key.models.join(', ') : '' })),
        LIMIT_FIELDS.map(([name, label]) => h('label', {}, label + ' (empty = none)',
          h('input', { name: name, type: 'number', min: name === 'max_concurrent' ? 1 : 0,
            step: name === 'budget_usd' ? '0.000001' : '1', value: key && key[name] !== null ? key[name] : '' }))),
        h('label', {}, 'Budget period',
          h('select', { name: 'budget_period' },
            ['total', 'day', 'month'].map((p) => h('option', { value: p, selected: key && key.budget_period === p }, p)))),
        h('label', {}, 'Expires (local time; empty = never)',
          h('input', { name: 'expires_at', type: 'datetime-local', value: localValue })),
        h('label', {}, 'Team (its limits apply too)', teamSelect(key)),
        h('label', {}, 'Weight (share of the local engine)',
          h('input', { name: 'weight', type: 'number', min: 0.001, step: 'any', value: key ? key.weight : 1 })),
        h('label', {}, 'Priority',
          h('select', { name: 'priority' }, ['high', 'normal', 'low'].map((p) => h('option',
            { value: p, selected: key ? key.priority === p : p === 'normal' }, p))))),
      h('label', {}, 'Metadata (JSON object)',
        h('textarea', { name: 'metadata', rows: 2 }, key && Object.keys(key.metadata).length ? JSON.stringify(key.metadata) : '')),
      h('div', { class: 'row' }, h('button', { type: 'submit' }, submitLabel)),
      error);
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      error.textContent = '';
      try {
        await onSubmit(formBody(form, key));
      } catch (e) {
        error.textContent = e instanceof SyntaxError ? 'Metadata is not valid JSON.' : e.message;
      }
    });
    return form;
  }

  function secretPanel(title, record) {
    const input = h('input', { readonly: true, value: record.key, id: 'new-secret', 'aria-label': 'New key' });
    const copy = h('button', { type: 'button', id: 'copy-secret', onclick: () => UG.copy(record.key, copy) }, 'Copy');
    const panel = h('div', { class: 'card secret', id: 'secret-panel' },
      h('h2', {}, title + ': ' + (record.name || record.id)),
      h('p', {}, h('strong', {}, 'Copy this key now: you will not see it again.'),
        ' unigate stores only its hash.'),
      h('div', { class: 'row' }, h('div', { class: 'grow' }, input), copy,
        h('button', { type: 'button', class: 'secondary', onclick: () => panel.remove() }, 'Done')));
    return panel;
  }

  UG.pages.keys = {
    title: 'Keys',
    render(root) {
      const state = { cursors: [null], index: 0, page: null, search: '', timer: 0, teams: {} };
      const notice = h('div');
      const tableBox = h('div', { class: 'table-wrap' });
      const pager = h('div', { class: 'row' });
      const createBox = h('div', { hidden: true });
      const search = h('input', { type: 'search', placeholder: 'Search name, id or prefix', id: 'key-search',
        oninput: () => {  // searched on the server (every key, not only this page), 250 ms after the last keystroke
          clearTimeout(state.timer);
          state.timer = setTimeout(() => {
            state.search = search.value.trim();
            state.cursors = [null];
            state.index = 0;
            load();
          }, 250);
        } });

      createBox.appendChild(h('div', { class: 'card' }, h('h2', {}, 'New key'),
        keyForm(null, async (body) => {
          const record = await UG.api('POST', '/admin/keys', body);
          createBox.hidden = true;
          UG.clear(notice).appendChild(secretPanel('New key created', record));
          await load();
        }, 'Create key')));

      root.appendChild(h('div', { class: 'row' }, h('h1', { class: 'grow' }, 'Keys'), search,
        h('button', { type: 'button', id: 'new-key', onclick: () => { createBox.hidden = !createBox.hidden; } },
          'New key')));
      root.append(createBox, notice, h('div', { class: 'card' }, tableBox, pager));

      async function load() {
        const after = state.cursors[state.index];
        const query = '?limit=' + PAGE_SIZE + (after ? '&after=' + encodeURIComponent(after) : '') +
          (state.search ? '&search=' + encodeURIComponent(state.search) : '');
        try {
          [state.page, state.teams] = await Promise.all([UG.api('GET', '/admin/keys' + query), UG.teamNames()]);
        } catch (e) {
          UG.clear(tableBox).appendChild(h('p', { class: 'error' }, e.message));
          return;
        }
        draw();
      }

      function draw() {
        const keys = state.page.data;
        const rows = keys.map((key) => {
          const spark = h('span', { class: 'spark', 'aria-label': 'tokens per day' });
          sparkline(key.id, spark);
          return h('tr', { 'data-key-id': key.id },
            h('td', {}, h('strong', {}, key.name || '(no name)'), h('div', { class: 'muted' }, key.id),
              key.team_id ? h('div', { class: 'muted', 'data-team': key.team_id },
                'team: ' + (state.teams[key.team_id] || key.team_id)) : null),
            h('td', { class: 'hide-narrow' }, h('code', {}, key.key_prefix)),
            h('td', {}, h('span', { class: 'badge ' + statusOf(key) }, statusOf(key))),
            h('td', { class: 'hide-narrow' }, key.models.length ? key.models.join(', ') : 'all'),
            h('td', { class: 'hide-narrow' }, limitsText(key)),
            h('td', { class: 'num' }, UG.fmt(key.tokens_spent)),
            h('td', { class: 'num' }, UG.fmt(key.num_requests)),
            h('td', {}, spark),
            h('td', {}, actions(key)));
        });
        UG.clear(tableBox).appendChild(h('table', { id: 'keys-table' },
          h('thead', {}, h('tr', {}, ['Key', 'Prefix', 'Status', 'Models', 'Limits', 'Tokens', 'Requests',
            SPARK_DAYS + ' days', ''].map((t, i) => h('th', { class: (i === 5 || i === 6 ? 'num' : '') +
            (i === 1 || i === 3 || i === 4 ? ' hide-narrow' : '') }, t)))),
          h('tbody', {}, rows.length ? rows : h('tr', {}, h('td', { colspan: 9, class: 'muted' }, 'No keys.')))));
        UG.clear(pager).append(
          h('button', { type: 'button', class: 'secondary', disabled: state.index === 0,
            onclick: () => { state.index--; load(); } }, 'Previous'),
          h('span', { class: 'muted' }, 'Page ' + (state.index + 1)),
          h('button', { type: 'button', class: 'secondary', disabled: !state.page.has_more, onclick: () => {
            state.cursors[state.index + 1] = state.page.last_id; state.index++; load();
          } }, 'Next'));
      }

      async function sparkline(keyId, container) {
        try {
          const usage = await UG.api('GET', '/admin/keys/' + encodeURIComponent(keyId) + '/usage?days=' + SPARK_DAYS);
          const perDay = {};
          for (const row of usage.data) perDay[row.date] = (perDay[row.date] || 0) + row.total_tokens;
          const values = [];
          const today = Date.now();
          for (let i = SPARK_DAYS - 1; i >= 0; i--) {
            values.push(perDay[new Date(today - i * 86400000).toISOString().slice(0, 10)] || 0);
          }
          container.dataset.total = String(values.reduce((a, b) => a + b, 0));
          UnigateCharts.sparkline(container, values, { width: 120, height: 24 });
        } catch (e) { container.textContent = '—'; }
      }

      function actions(key) {
        const requests = h('a', { href: '#/requests?key=' + encodeURIComponent(key.id), class: 'link',
          'data-action': 'requests' }, 'Requests');
        if (key.revoked) {
          return h('span', {}, requests, h('span', { class: 'muted' }, ' revoked ' + (key.revoked_at || '')));
        }
        return h('span', {}, requests,
          h('button', { type: 'button', class: 'link', onclick: () => edit(key) }, 'Edit'),
          h('button', { type: 'button', class: 'link', onclick: () => rotate(key) }, 'Rotate'),
          h('button', { type: 'button', class: 'link', 'data-action': 'revoke', onclick: () => revoke(key) }, 'Revoke'));
      }

      function edit(key) {
        UG.clear(notice).appendChild(h('div', { class: 'card', id: 'edit-panel' },
          h('div', { class: 'row' }, h('h2', { class: 'grow' }, 'Edit ' + (key.name || key.id)),
            h('button', { type: 'button', class: 'secondary', onclick: () => UG.clear(notice) }, 'Close')),
          keyForm(key, async (body) => {
            if (Object.keys(body).length) await UG.api('PATCH', '/admin/keys/' + encodeURIComponent(key.id), body);
            UG.clear(notice);
            await load();
          }, 'Save changes')));
      }

      async function rotate(key) {
        if (!await UG.confirm('Rotate ' + (key.name || key.id) + '? Its current secret stops working at once.', 'Rotate')) {
          return;
        }
        try {
          const record = await UG.api('POST', '/admin/keys/' + encodeURIComponent(key.id) + '/rotate', {});
          UG.clear(notice).appendChild(secretPanel('Key rotated', record));
          await load();
        } catch (e) { UG.clear(notice).appendChild(h('p', { class: 'error' }, e.message)); }
      }

      async function revoke(key) {
        if (!await UG.confirm('Revoke ' + (key.name || key.id) + '? Every request with it fails from now on; this ' +
          'cannot be undone.', 'Revoke')) return;
        try {
          await UG.api('DELETE', '/admin/keys/' + encodeURIComponent(key.id));
          UG.clear(notice);
          await load();
        } catch (e) { UG.clear(notice).appendChild(h('p', { class: 'error' }, e.message)); }
      }

      load();
    },
  };
})();
