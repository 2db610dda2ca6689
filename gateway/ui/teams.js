/* Teams: list with spend against budgets, create, edit limits, members (move keys in and out), delete. */
(function () {
  'use strict';
  const UG = window.UG;
  const h = UG.h;
  const SVG = 'http://www.w3.org/2000/svg';
  const LIMIT_FIELDS = [
    ['rpm', 'Requests / min'], ['tpm', 'Tokens / min'], ['max_concurrent', 'Max concurrent'],
    ['token_budget', 'Token budget'], ['budget_usd', 'Budget (USD)'],
  ];

  function limitsText(team) {
    const parts = [];
    if (team.rpm !== null) parts.push(team.rpm + ' rpm');
    if (team.tpm !== null) parts.push(team.tpm + ' tpm');
    if (team.max_concurrent !== null) parts.push(team.max_concurrent + ' conc.');
    return parts.join(', ') || 'no rate limits';
  }

  /** A bar filled to spent / limit (red once spent); drawn as SVG attributes, so the CSP needs no inline style. */
  function meter(spent, limit) {
    const fraction = limit > 0 ? Math.min(1, spent / limit) : (spent > 0 ? 1 : 0);
    const svg = document.createElementNS(SVG, 'svg');
    svg.setAttribute('width', '100%');
    svg.setAttribute('height', '8');
    svg.setAttribute('aria-hidden', 'true');
    const bar = document.createElementNS(SVG, 'rect');
    bar.setAttribute('width', (100 * fraction).toFixed(1) + '%');
    bar.setAttribute('height', '8');
    bar.setAttribute('fill', fraction >= 1 ? '#c0392b' : fraction >= 0.8 ? '#c98a00' : '#2e8b57');
    svg.appendChild(bar);
    return h('div', { class: 'meter' }, svg);
  }

  /** Spend against the dollar budget, and tokens against the token budget, for one team row. */
  function budgets(team) {
    const period = team.budget_period === 'total' ? '' : ' this ' + team.budget_period;
    const usd = team.budget_usd === null
      ? h('div', { 'data-budget': 'usd' }, '$' + UG.fmt(team.spend_usd, 6) + ' spent (no budget)')
      : h('div', { 'data-budget': 'usd' }, '$' + UG.fmt(team.budget_usd_spent, 6) + ' of $' + UG.fmt(team.budget_usd, 6) +
        period, meter(team.budget_usd_spent, team.budget_usd));
    const tokens = team.token_budget === null ? null
      : h('div', { 'data-budget': 'tokens' }, UG.fmt(team.budget_spent) + ' of ' + UG.fmt(team.token_budget) +
        ' tokens' + period, meter(team.budget_spent, team.token_budget));
    return h('div', {}, usd, tokens);
  }

  /** The fields of a create / edit form as an admin API body; on edit only the changed ones (an emptied limit: null). */
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
    set('weight', value('weight') === '' ? 1 : Number(value('weight')));
    set('priority', value('priority'));
    const metadata = value('metadata');
    if (metadata || original) set('metadata', metadata ? JSON.parse(metadata) : {});
    return body;
  }

  function teamForm(team, onSubmit, submitLabel) {
    const error = h('p', { class: 'error', role: 'alert' });
    const form = h('form', { class: 'team-form', autocomplete: 'off' },
      h('div', { class: 'grid' },
        h('label', {}, 'Name', h('input', { name: 'name', value: team ? team.name : '', maxlength: 200, required: true })),
        h('label', {}, 'Models (comma-separated, * wildcards; empty = all)',
          h('input', { name: 'models', value: team ? team.models.join(', ') : '' })),
        LIMIT_FIELDS.map(([name, label]) => h('label', {}, label + ' (empty = none)',
          h('input', { name: name, type: 'number', min: name === 'max_concurrent' ? 1 : 0,
            step: name === 'budget_usd' ? '0.000001' : '1', value: team && team[name] !== null ? team[name] : '' }))),
        h('label', {}, 'Budget period',
          h('select', { name: 'budget_period' },
            ['total', 'day', 'month'].map((p) => h('option', { value: p, selected: team && team.budget_period === p }, p)))),
        h('label', {}, 'Weight (share of the local engine)',
          h('input', { name: 'weight', type: 'number', min: 0.001, step: 'any', value: team ? team.weight : 1 })),
        h('label', {}, 'Priority',
          h('select', { name: 'priority' }, ['high', 'normal', 'low'].map((p) => h('option',
            { value: p, selected: team ? team.priority === p : p === 'normal' }, p))))),
      h('label', {}, 'Metadata (JSON object)',
        h('textarea', { name: 'metadata', rows: 2 },
          team && Object.keys(team.metadata).length ? JSON.stringify(team.metadata) : '')),
      h('div', { class: 'row' }, h('button', { type: 'submit' }, submitLabel)),
      error);
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      error.textContent = '';
      try {
        await onSubmit(formBody(form, team));
      } catch (e) {
        error.textContent = e instanceof SyntaxError ? 'Metadata is not valid JSON.' : e.message;
      }
    });
    return form;
  }

  UG.pages.teams = {
    title: 'Teams',
    render(root) {
      const notice = h('div');
      const tableBox = h('div', { class: 'table-wrap' });
      const createBox = h('div', { hidden: true });
      let teams = [];

      createBox.appendChild(h('div', { class: 'card' }, h('h2', {}, 'New team'),
        teamForm(null, async (body) => {
          await UG.api('POST', '/admin/teams', body);
          createBox.hidden = true;
          await load();
        }, 'Create team')));
      root.appendChild(h('div', { class: 'row' }, h('h1', { class: 'grow' }, 'Teams'),
        h('button', { type: 'button', id: 'new-team', onclick: () => { createBox.hidden = !createBox.hidden; } },
          'New team')));
      root.append(h('p', { class: 'muted' }, 'A key in a team is admitted only when its own limits and its ' +
        "team's both allow the request; the team's budgets count every request of its keys."),
      createBox, notice, h('div', { class: 'card' }, tableBox));

      async function load() {
        teams = [];
        try {
          let after = null;
          do {  // every team: an operator has tens, not thousands
            const page = await UG.api('GET', '/admin/teams?limit=500' + (after ? '&after=' + encodeURIComponent(after) : ''));
            teams = teams.concat(page.data);
            after = page.has_more ? page.last_id : null;
          } while (after);
        } catch (e) {
          UG.clear(tableBox).appendChild(h('p', { class: 'error' }, e.message));
          return;
        }
        draw();
      }

      function draw() {
        const rows = teams.map((team) => h('tr', { 'data-team-id': team.id },
          h('td', {}, h('strong', {}, team.name), h('div', { class: 'muted' }, team.id)),
          h('td', { class: 'num', 'data-num-keys': team.num_keys }, UG.fmt(team.num_keys)),
          h('td', { class: 'hide-narrow' }, team.models.length ? team.models.join(', ') : 'all'),
          h('td', { class: 'hide-narrow' }, limitsText(team)),
          h('td', {}, budgets(team)),
          h('td', { class: 'hide-narrow' }, 'weight ' + UG.fmt(team.weight, 3) + ', ' + team.priority),
          h('td', {}, h('span', {},
            h('button', { type: 'button', class: 'link', onclick: () => members(team) }, 'Members'),
            h('button', { type: 'button', class: 'link', onclick: () => edit(team) }, 'Edit'),
            h('button', { type: 'button', class: 'link', 'data-action': 'delete', onclick: () => remove(team) },
              'Delete')))));
        UG.clear(tableBox).appendChild(h('table', { id: 'teams-table' },
          h('thead', {}, h('tr', {}, ['Team', 'Keys', 'Models', 'Limits', 'Spend against budget', 'Engine share', '']
            .map((t, i) => h('th', { class: (i === 1 ? 'num' : '') + (i === 2 || i === 3 || i === 5 ? ' hide-narrow' : '') },
              t)))),
          h('tbody', {}, rows.length ? rows
            : h('tr', {}, h('td', { colspan: 7, class: 'muted' }, 'No teams yet: create one, then add keys to it.')))));
      }

      function panel(id, title, ...content) {
        UG.clear(notice).appendChild(h('div', { class: 'card', id: id },
          h('div', { class: 'row' }, h('h2', { class: 'grow' }, title),
            h('button', { type: 'button', class: 'secondary', onclick: () => UG.clear(notice) }, 'Close')),
          content));
      }

      function edit(team) {
        panel('team-edit-panel', 'Edit ' + team.name, teamForm(team, async (body) => {
          if (Object.keys(body).length) await UG.api('PATCH', '/admin/teams/' + encodeURIComponent(team.id), body);
          UG.clear(notice);
          await load();
        }, 'Save changes'));
      }

      /** The team's keys (each can leave), and every other key that can join (from another team or none). */
      async function members(team) {
        const list = h('div', { class: 'table-wrap' });
        const picker = h('select', { id: 'member-add', 'aria-label': 'Key to add' });
        const error = h('p', { class: 'error', role: 'alert' });
        panel('members-panel', 'Members of ' + team.name, list,
          h('div', { class: 'row' }, h('label', {}, 'Add a key (it leaves its current team)', picker),
            h('button', { type: 'button', id: 'member-add-button', onclick: () => move(picker.value, team.id) },
              'Add to team')),
          error);

        async function move(keyId, teamId) {
          if (!keyId) return;
          error.textContent = '';
          try {
            await UG.api('PATCH', '/admin/keys/' + encodeURIComponent(keyId), { team_id: teamId });
            await refresh();
            await load();
          } catch (e) { error.textContent = e.message; }
        }

        async function refresh() {
          let inTeam;
          let all = [];
          try {
            inTeam = (await UG.api('GET', '/admin/teams/' + encodeURIComponent(team.id) + '/keys')).data;
            let after = null;
            do {
              const page = await UG.api('GET', '/admin/keys?limit=500' + (after ? '&after=' + encodeURIComponent(after) : ''));
              all = all.concat(page.data);
              after = page.has_more ? page.last_id : null;
            } while (after);
          } catch (e) { error.textContent = e.message; return; }
          const names = Object.fromEntries(teams.map((t) => [t.id, t.name]));
          UG.clear(list).appendChild(h('table', { id: 'members-table' },
            h('thead', {}, h('tr', {}, ['Key', 'Status', 'Tokens', 'Spend (USD)', ''].map((t) => h('th', {}, t)))),
            h('tbody', {}, inTeam.length ? inTeam.map((key) => h('tr', { 'data-key-id': key.id },
              h('td', {}, h('strong', {}, key.name || '(no name)'), h('div', { class: 'muted' }, key.id)),
              h('td', {}, key.revoked ? 'revoked' : key.is_expired ? 'expired' : 'active'),
              h('td', { class: 'num' }, UG.fmt(key.tokens_spent)),
              h('td', { class: 'num' }, UG.fmt(key.spend_usd, 6)),
              h('td', {}, h('button', { type: 'button', class: 'link', 'data-action': 'leave',
                onclick: () => move(key.id, null) }, 'Remove from team'))))
              : h('tr', {}, h('td', { colspan: 5, class: 'muted' }, 'No keys in this team.')))));
          const candidates = all.filter((key) => !key.revoked && key.team_id !== team.id);
          UG.clear(picker).append(h('option', { value: '' }, candidates.length ? 'Choose a key…' : 'No other keys'),
            ...candidates.map((key) => h('option', { value: key.id }, (key.name || '(no name)') + ' · ' + key.id +
              (key.team_id ? ' (in ' + (names[key.team_id] || key.team_id) + ')' : ''))));
        }

        await refresh();
      }

      async function remove(team) {
        const message = team.num_keys
          ? 'Delete ' + team.name + '? Its ' + team.num_keys + ' key(s) leave the team and keep working under their ' +
            "own limits; the team's usage history is deleted."
          : 'Delete ' + team.name + "? The team's usage history is deleted.";
        if (!await UG.confirm(message, 'Delete')) return;
        try {
          await UG.api('DELETE', '/admin/teams/' + encodeURIComponent(team.id) + (team.num_keys ? '?force=true' : ''));
          UG.clear(notice);
          await load();
        } catch (e) { UG.clear(notice).appendChild(h('p', { class: 'error' }, e.message)); }
      }

      load();
    },
  };
})();
