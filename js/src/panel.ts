/**
 * The world panel: a side panel that shows the world of each of the user's kernels at a glance, from
 * nbdist/api/worlds (the server reads what the kernel wrote, so it answers while a cell runs): every
 * rank's state (idle, busy at which cell line, in its debugger, failed, dead, restarting), host, device
 * and memory, grouped above 8 ranks; the slowest rank and what holds it. Actions, each usable while a
 * cell runs: interrupt the cell (Jupyter's own route); restart the dead ranks and stop the world (the
 * server's action route: done as soon as the running cell has stopped, as the kernel takes one request at a
 * time, and answered with the result); the cell's dashboard as a tab.
 */
import { JupyterFrontEnd } from '@jupyterlab/application';
import { MainAreaWidget } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { IRenderMimeRegistry, MimeModel } from '@jupyterlab/rendermime';
import { ServerConnection } from '@jupyterlab/services';
import { PanelLayout, Widget } from '@lumino/widgets';

interface IRank {
  rank: number;
  state: string;
  line: number | null;
  text: string; // the state as every view says it ('busy at cell line 7'), served from nbdist/results.py
  colour: string; // its colour, from the same place
  host: string;
  device: string;
  rss_MiB: number | null;
  gpu_MiB: number | null;
  gpu_total_MiB: number | null;
}

interface IWorld {
  kernel: string;
  notebook: string;
  ranks: IRank[];
  groups: string[];
  slowest: { rank: number; pct: number; holds: string } | null;
}

const EVERY_MS = 1000;
// An action's line ('interrupt sent') is shown this long, then goes; one still waiting for the running cell stays
// until its answer replaces it.
const SAID_MS = 15000;
const WAITING = 'after the running cell';

function el(tag: string, text = '', cls = ''): HTMLElement {
  const node = document.createElement(tag);
  node.textContent = text;
  if (cls) {
    node.className = cls;
  }
  return node;
}

/** '812 MiB', with the GPU's where the rank has one: '812 MiB · GPU 1234 / 143771 MiB'. */
function memoryText(rank: IRank): string {
  const parts = [];
  if (rank.rss_MiB !== null && rank.rss_MiB !== undefined) {
    parts.push(`${rank.rss_MiB} MiB`);
  }
  if (rank.gpu_MiB !== null && rank.gpu_MiB !== undefined && rank.gpu_total_MiB) {
    parts.push(`GPU ${rank.gpu_MiB} / ${rank.gpu_total_MiB} MiB`);
  }
  return parts.join(' · ');
}

export class WorldPanel extends Widget {
  private timer: number | undefined;
  private said = new Map<string, { line: string; at: number }>(); // kernel -> the last action's line, and when

  constructor(
    private app: JupyterFrontEnd,
    private rendermime: IRenderMimeRegistry
  ) {
    super();
    this.id = 'nbdist-worlds';
    this.title.label = 'nbdist';
    this.title.caption = 'nbdist: the ranks of your worlds';
    this.addClass('nbdist-WorldPanel');
    this.node.style.overflowY = 'auto';
    this.node.style.padding = '6px 8px';
    this.node.style.fontSize = '12px';
    this.schedule(0);
  }

  dispose(): void {
    window.clearTimeout(this.timer);
    super.dispose();
  }

  private schedule(ms: number): void {
    window.clearTimeout(this.timer);
    this.timer = window.setTimeout(() => void this.refresh(), ms);
  }

  private get settings(): ServerConnection.ISettings {
    return this.app.serviceManager.serverSettings;
  }

  async refresh(): Promise<void> {
    try {
      if (this.isVisible) {
        const url = URLExt.join(this.settings.baseUrl, 'nbdist/api/worlds');
        const response = await ServerConnection.makeRequest(url, {}, this.settings);
        if (response.ok) {
          this.draw((await response.json()).worlds);
        } else {
          this.node.replaceChildren(el('div', `nbdist: the server answered ${response.status}`, 'nbdist-error'));
        }
      }
    } catch (reason) {
      this.node.replaceChildren(el('div', `nbdist: ${reason}`, 'nbdist-error'));
    }
    this.schedule(EVERY_MS);
  }

  private draw(worlds: IWorld[]): void {
    const body: HTMLElement[] = [];
    if (!worlds.length) {
      body.push(el('div', 'No world. Start one in a notebook: %dist_start -n 2', 'nbdist-empty'));
    }
    for (const world of worlds) {
      body.push(this.drawWorld(world));
    }
    this.node.replaceChildren(...body);
  }

  private drawWorld(world: IWorld): HTMLElement {
    const box = el('div', '', 'nbdist-world');
    box.dataset.kernel = world.kernel;
    box.style.marginBottom = '12px';
    const head = el('div', `${world.notebook || world.kernel} · ${world.ranks.length} ranks`, 'nbdist-world-title');
    head.style.fontWeight = '600';
    box.appendChild(head);
    if (world.slowest) {
      const s = world.slowest;
      const slow =
        s.pct < 3
          ? 'ranks within 3% of each other'
          : `rank ${s.rank} slowest, +${s.pct}%, held by ${s.holds}`;
      box.appendChild(el('div', slow, 'nbdist-slowest'));
    }
    const actions = el('div', '', 'nbdist-actions');
    actions.style.margin = '4px 0';
    actions.style.display = 'flex';
    actions.style.flexWrap = 'wrap';
    actions.style.gap = '4px';
    const dead = world.ranks.filter(r => r.state === 'dead').map(r => r.rank);
    actions.appendChild(this.button('Interrupt', 'interrupt the running cell on every rank', () => this.interrupt(world)));
    if (dead.length) {
      actions.appendChild(
        this.button(`Restart ${dead.length === 1 ? 'rank ' + dead[0] : dead.length + ' dead ranks'}`, 'restart the dead ranks', () =>
          this.act(world, 'restart', dead, `restarting rank(s) ${dead.join(', ')}`)
        )
      );
    }
    actions.appendChild(
      this.button('Dashboard', "the running cell's dashboard as a tab", async () => this.openDashboard(world))
    );
    actions.appendChild(this.button('Stop', 'interrupt the cell, then stop the world', () => this.stop(world)));
    box.appendChild(actions);
    const said = this.said.get(world.kernel);
    if (said && (said.line.includes(WAITING) || Date.now() - said.at < SAID_MS)) {
      box.appendChild(el('div', said.line, 'nbdist-said'));
    }
    if (world.groups.length) {
      for (const line of world.groups) {
        box.appendChild(el('div', line, 'nbdist-group'));
      }
    } else {
      // Four columns with headers; only the state may wrap (it says what a rank waits for), the rest stay on one
      // line at the panel's default width.
      const table = el('table', '', 'nbdist-ranks');
      table.style.borderCollapse = 'collapse';
      table.style.width = '100%';
      const head = el('tr', '', 'nbdist-ranks-head');
      for (const name of ['rank', 'state', 'where', 'memory']) {
        const th = el('th', name);
        th.style.textAlign = 'left';
        th.style.fontWeight = '600';
        th.style.padding = '1px 4px 1px 0';
        head.appendChild(th);
      }
      table.appendChild(head);
      for (const rank of world.ranks) {
        const row = el('tr', '', 'nbdist-rank');
        row.dataset.rank = String(rank.rank);
        row.dataset.state = rank.state;
        const state = el('td', rank.text || rank.state, 'nbdist-state');
        state.style.color = rank.colour || '#555';
        const cells = [el('td', String(rank.rank)), state, el('td', `${rank.host} · ${rank.device}`), el('td', memoryText(rank))];
        for (const [i, cell] of cells.entries()) {
          cell.style.padding = '1px 4px 1px 0';
          cell.style.verticalAlign = 'top';
          cell.style.whiteSpace = i === 1 ? 'normal' : 'nowrap';
        }
        row.append(...cells);
        table.appendChild(row);
      }
      box.appendChild(table);
    }
    return box;
  }

  private button(label: string, title: string, action: () => Promise<void>): HTMLElement {
    const button = el('button', label, 'jp-Button jp-mod-styled nbdist-action') as HTMLButtonElement;
    button.title = title;
    button.style.padding = '0 6px'; // four fit on one line at the panel's default width
    button.style.minWidth = '0';
    button.style.whiteSpace = 'nowrap';
    button.onclick = () => void action();
    return button;
  }

  private async interrupt(world: IWorld): Promise<void> {
    const url = URLExt.join(this.settings.baseUrl, 'api/kernels', world.kernel, 'interrupt');
    const response = await ServerConnection.makeRequest(url, { method: 'POST' }, this.settings);
    const pending = this.said.get(world.kernel)?.line || '';
    const sent = response.ok ? 'interrupt sent' : `interrupt refused: ${response.status}`;
    this.say(world, pending.includes(WAITING) ? `${sent}; ${pending}` : sent);
  }

  private async stop(world: IWorld): Promise<void> {
    await this.interrupt(world);
    await this.act(world, 'stop', null, 'stopping the world');
  }

  /**
   * Asks the server to do a panel action in the world's kernel (nbdist/api/kernels/<id>/actions): done at once
   * when the kernel is idle, else right after the running cell; the answer is its result, shown as it is.
   */
  private async act(world: IWorld, action: string, ranks: number[] | null, doing: string): Promise<void> {
    this.say(world, `${doing} (${WAITING}, if one runs)`);
    const url = URLExt.join(this.settings.baseUrl, 'nbdist/api/kernels', world.kernel, 'actions');
    try {
      const response = await ServerConnection.makeRequest(
        url,
        { method: 'POST', body: JSON.stringify({ action, ranks }) },
        this.settings
      );
      const answer = await response.json();
      if (!response.ok) {
        this.say(world, `${doing}: refused: ${answer.message || response.status}`);
        return;
      }
      this.say(world, answer.ok ? answer.line : `${doing}: ${answer.line}`);
    } catch (reason) {
      this.say(world, `${doing}: ${reason}`);
    }
  }

  private say(world: IWorld, line: string): void {
    this.said.set(world.kernel, { line, at: Date.now() });
    this.schedule(0);
  }

  private openDashboard(world: IWorld): void {
    const content = new DashboardView(world.kernel, this.settings, this.rendermime);
    const tab = new MainAreaWidget({ content });
    tab.id = `nbdist-dashboard-${world.kernel}`;
    tab.title.label = `Dashboard · ${world.notebook || world.kernel}`;
    tab.title.closable = true;
    this.app.shell.add(tab, 'main');
    this.app.shell.activateById(tab.id);
  }
}

/** The dashboard of a kernel's last distributed cell, redrawn from the server while it changes. */
class DashboardView extends Widget {
  private version = -1;
  private timer: number | undefined;

  constructor(
    private kernel: string,
    private settings: ServerConnection.ISettings,
    private rendermime: IRenderMimeRegistry
  ) {
    super();
    this.addClass('nbdist-DashboardView');
    this.node.style.overflowY = 'auto';
    this.node.style.padding = '8px';
    // The figure is a child widget, not a bare node: it is told when the tab is shown or resized, and plotly
    // draws at the tab's width (a renderer drawn before it was attached took plotly's default, half the tab).
    this.layout = new PanelLayout();
    void this.refresh();
  }

  /** Show ``widget`` in place of what was shown. */
  private showOnly(widget: Widget): void {
    const layout = this.layout as PanelLayout;
    for (const old of [...layout.widgets]) {
      old.dispose();
    }
    layout.addWidget(widget);
  }

  private say(text: string): void {
    const note = new Widget();
    note.node.textContent = text;
    this.showOnly(note);
  }

  dispose(): void {
    window.clearTimeout(this.timer);
    super.dispose();
  }

  private async refresh(): Promise<void> {
    let running = true;
    try {
      const url = URLExt.join(this.settings.baseUrl, 'nbdist/api/kernels', this.kernel, 'cells');
      const response = await ServerConnection.makeRequest(url, {}, this.settings);
      const cells = response.ok ? (await response.json()).cells : [];
      const last = cells.length ? cells[cells.length - 1] : null;
      running = !!last && last.running;
      const figure = last ? last.outputs.find((o: any) => o.data && o.data['application/vnd.plotly.v1+json']) : null;
      if (!figure) {
        this.say('No dashboard yet: the last distributed cell logged no metrics.');
      } else if (last.version !== this.version) {
        this.version = last.version;
        const mime = this.rendermime.preferredMimeType(figure.data, 'any') || 'text/plain';
        const renderer = this.rendermime.createRenderer(mime);
        this.showOnly(renderer); // attached first, then drawn: at the tab's width
        await renderer.renderModel(new MimeModel({ data: figure.data, trusted: true }));
      }
    } catch (reason) {
      this.say(`nbdist: ${reason}`);
    }
    if (!this.isDisposed) {
      this.timer = window.setTimeout(() => void this.refresh(), running ? EVERY_MS : 5 * EVERY_MS);
    }
  }
}
